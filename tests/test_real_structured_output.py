"""Structured output end to end on the real default pair: `viasd serve` as users start it (methods auto and plain),
the official OpenAI client's `beta.chat.completions.parse` with a pydantic model, and langchain-openai's
`with_structured_output` (its default method, json_schema), each answer a valid instance of the model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from test_serve import Server, real_server

pytestmark = pytest.mark.real


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    population_millions: float
    is_capital: bool


QUESTION = "Describe Paris as JSON: its name, country, population in millions and whether it is a capital."


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with real_server(Path(tmp_path_factory.mktemp("structured"))) as started:
        yield started


def test_openai_parse_with_a_pydantic_model(server: Server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    for method in ("auto", "plain"):
        completion = client.beta.chat.completions.parse(
            model=model,
            messages=[{"role": "user", "content": QUESTION}],
            response_format=City,
            temperature=0,
            max_tokens=80,
            extra_body={"method": method},
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice
        city = choice.message.parsed
        assert isinstance(city, City) and city.name.strip(), (method, choice.message.content)


def test_langchain_with_structured_output(server: Server) -> None:
    model = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none").models.list().data[0].id
    llm = ChatOpenAI(base_url=f"{server.url}/v1", api_key="none", model=model, temperature=0, max_tokens=80)
    city = llm.with_structured_output(City).invoke(QUESTION)  # method="json_schema" is langchain-openai's default
    assert isinstance(city, City) and city.country.strip()
