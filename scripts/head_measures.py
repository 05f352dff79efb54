"""Teacher-forced measures of draft heads on written training data: top-1 per draft step over every answer position
(a token outside a head's vocabulary counts as missed) and the drafts a chain of `--depth` keeps, by the training's
own unroll (`held_out_measures`). A chain head is measured as the attention head it starts (the same drafts).

    python scripts/head_measures.py --head src/viasd/heads/shipped/qwen2.5-coder-1.5b.safetensors --head B \\
        --data ~/.cache/viasd/heads/<fingerprint>/data-tasks              # every conversation of a folder
    python scripts/head_measures.py --head H --data .../data --last 48  # its last 48 (training's held-out tail)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from viasd.engine import Engine, EngineSpec
from viasd.heads.attention import AttentionHead, AttentionHeadConfig
from viasd.heads.find import find_head
from viasd.training.attention_unroll import conversation_bounds, held_out_measures
from viasd.training.dataset import DataFolder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head", action="append", required=True, help="a head file (repeat for several)")
    parser.add_argument("--data", type=Path, required=True, help="a training-data folder of viasd train-drafter")
    parser.add_argument("--last", type=int, default=0, help="only its last N conversations (0: all)")
    parser.add_argument("--depth", type=int, default=4)
    args = parser.parse_args()
    model = Engine(EngineSpec()).target.model
    embeddings = model.get_input_embeddings().weight.detach().float()
    output = model.get_output_embeddings().weight.detach()
    with open(args.data / "settings.json", "rb") as settings:
        data = DataFolder(args.data, json.load(settings)).load()
    answer_from, row_of = conversation_bounds(data)
    conversations = list(range(data.conversations))[-args.last :] if args.last else list(range(data.conversations))
    for path in args.head:
        head = find_head(model, path).head
        if not isinstance(head, AttentionHead):  # the chain head: an attention head whose attention adds nothing
            chain = head
            head = AttentionHead(
                AttentionHeadConfig(embeddings.shape[1], width=chain.config.width, vocab=chain.config.vocab),
                chain.token_ids,
            )
            head.block.load_state_dict(chain.blocks[0].state_dict())
        head = head.float()
        rows = output[head.token_ids].float()
        with torch.inference_mode():
            measured = held_out_measures(
                head, embeddings, rows, head.token_ids, data, conversations, answer_from, row_of, args.depth
            )
        print(json.dumps({"head": path, "data": str(args.data), **measured}))


if __name__ == "__main__":
    main()
