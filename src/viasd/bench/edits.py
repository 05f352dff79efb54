"""The edit workload: tasks whose answers copy long runs of their input or of an earlier answer.

This is the work a coder model is run for ("fix this function", "add type hints", "rename", "revise your answer"),
built deterministically from data the benchmark already ships, with a check of every answer:

- `edit_types`, `edit_rename`, `edit_fix`, `edit_comprehension`: a HumanEval problem's canonical solution (its prompt
  and solution, a whole module) with an instruction; the answer is the whole edited code. It passes when its code
  runs the problem's tests to their end (in the HumanEval sandbox) and the kind's own check holds: annotations on
  every parameter and the return and a docstring (types); the new name present and the old one gone as an
  identifier (rename); no `for` loop that appends, a comprehension instead (comprehension). `edit_fix` shows the
  solution with one injected bug (a flipped comparison, or a range's end one short), which fails the tests.
- `chat_revise`: two turns; the first is a question's first turn, the second asks for the first answer again,
  word for word, under a given first line. Its score is how much of the first answer the second one copied.

Every task's key is `CATEGORY:BASE`, BASE the key of the problem or question it was made from, and it lies in
BASE's calibration or report split (`splits.split_of`), so no problem's code is in both splits.
"""

from __future__ import annotations

import ast
import difflib
import itertools
import re
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from viasd.bench.sandbox import ExecutionResult, run_program
from viasd.bench.task import Task

EDIT_SOURCE = "edit"
REVISE_SOURCE = "revise"
EDIT_KINDS = ("edit_types", "edit_rename", "edit_fix", "edit_comprehension")
REVISE_CATEGORY = "chat_revise"
DERIVED_CATEGORIES = (*EDIT_KINDS, REVISE_CATEGORY)
EDIT_METRIC = "pass@1"
REVISE_METRIC = "revise_copy"
CODE_PREFIX = "```python\n"
CODE_STOP = ("\n```",)
REPLY = "Reply with the whole code, changed only where needed, in one ```python code block."
# Names a rename may give, tried in this order from a place set by the task's key; one already in the code is skipped.
NEW_NAMES = ("items", "values", "data", "value", "element", "number", "result_list", "count", "current", "total")
# First lines the revise turn asks for, one chosen per task by its key.
REVISE_MARKS = ("REVISED ANSWER", "Here is my answer again:", "Second version")
_FLIPS = {ast.Lt: ("<", "<="), ast.LtE: ("<=", "<"), ast.Gt: (">", ">="), ast.GtE: (">=", ">")}
_FLIPS |= {ast.Eq: ("==", "!="), ast.NotEq: ("!=", "==")}


def derived_key(category: str, base: str) -> str:
    """The key of a task made from the task keyed `base` (`edit_fix:humaneval/HumanEval/12`)."""
    return f"{category}:{base}"


def _pick(key: str, n: int) -> int:
    """A fixed index below n chosen by a key (the same on every machine)."""
    return zlib.crc32(key.encode("utf-8")) % n


# ------------------------------------------------------------------------------------- code analysis


def solution_code(problem: Mapping[str, Any]) -> str:
    """A HumanEval problem's canonical solution as a whole module: its prompt, then the solution's body."""
    return problem["prompt"] + problem["canonical_solution"]


def entry_function(tree: ast.Module, name: str) -> ast.FunctionDef | None:
    """The module-level function `name` (the last definition of it), or None."""
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    return found[-1] if found else None


def _offsets(source: str) -> list[int]:
    """The character offset at which each line (1-based; index 0 unused) starts."""
    starts = [0, 0]
    for line in source.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    return starts


def _position(source: str, starts: Sequence[int], line: int, col: int) -> int:
    """A character offset from ast's line and UTF-8 byte column."""
    text = source[starts[line] : starts[line + 1] if line + 1 < len(starts) else len(source)]
    return starts[line] + len(text.encode("utf-8")[:col].decode("utf-8", "replace"))


@dataclass(frozen=True)
class Bug:
    """One injected bug: the code's text from `start` to `end` becomes `text`; `what` says what it did."""

    start: int
    end: int
    text: str
    what: str

    def apply(self, source: str) -> str:
        return source[: self.start] + self.text + source[self.end :]


def bug_candidates(source: str, entry_point: str, body_from: int = 0) -> list[Bug]:
    """The bugs that can be injected into `entry_point`'s code at or after character `body_from`, in source order:
    a comparison flipped (`<` and `<=`, `>` and `>=`, `==` and `!=`) or a `range`'s end made one short."""
    tree = ast.parse(source)
    function = entry_function(tree, entry_point)
    if function is None:
        return []
    starts = _offsets(source)

    def at(node: ast.AST, end: bool = False) -> int:
        if end:
            return _position(source, starts, node.end_lineno or 0, node.end_col_offset or 0)
        return _position(source, starts, node.lineno, node.col_offset)

    bugs: list[Bug] = []
    for node in ast.walk(function):
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _FLIPS:
            old, new = _FLIPS[type(node.ops[0])]
            left_end, right_start = at(node.left, end=True), at(node.comparators[0])
            gap = source[left_end:right_start]
            if gap.strip(" ()\t") == old:
                start = left_end + gap.index(old)
                bugs.append(Bug(start, start + len(old), new, f"`{old}` became `{new}`"))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "range"
            and 1 <= len(node.args) <= 2
            and not node.keywords
        ):
            stop = node.args[-1]
            end = at(stop, end=True)
            bugs.append(Bug(end, end, " - 1", "a range's end became one short"))
    return sorted((b for b in bugs if b.start >= body_from), key=lambda b: b.start)


def _annotations_complete(function: ast.FunctionDef) -> bool:
    args = [*function.args.posonlyargs, *function.args.args, *function.args.kwonlyargs]
    args += [a for a in (function.args.vararg, function.args.kwarg) if a is not None]
    return function.returns is not None and all(a.annotation is not None for a in args)


def strip_types(source: str, entry_point: str) -> str:
    """The code without the entry function's annotations and docstring (ast's layout: comments are lost)."""
    tree = ast.parse(source)
    function = entry_function(tree, entry_point)
    assert function is not None
    args = [*function.args.posonlyargs, *function.args.args, *function.args.kwonlyargs]
    for arg in [*args, function.args.vararg, function.args.kwarg]:
        if arg is not None:
            arg.annotation = None
    function.returns = None
    if ast.get_docstring(function, clean=False) is not None:
        function.body = function.body[1:] or [ast.Pass()]
    return ast.unparse(tree) + "\n"


def rename_candidates(source: str, entry_point: str) -> list[str]:
    """Names a rename can ask for: the entry function's parameters, then its local variables (not a comprehension's
    own), in order."""
    tree = ast.parse(source)
    function = entry_function(tree, entry_point)
    if function is None:
        return []
    module_names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} - _local_names(function)
    module_names |= {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    names = [a.arg for a in [*function.args.posonlyargs, *function.args.args, *function.args.kwonlyargs]]
    in_comprehensions = {
        n.id
        for c in ast.walk(function)
        if isinstance(c, ast.comprehension)
        for n in ast.walk(c.target)
        if isinstance(n, ast.Name)
    }  # a comprehension's own variable is no variable of the function
    names += [
        n.id
        for n in ast.walk(function)
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store) and n.id not in in_comprehensions
    ]  # assignments, loop targets
    out = [n for n in dict.fromkeys(names) if n not in module_names and not n.startswith("_") and n != entry_point]
    return out


def _local_names(function: ast.FunctionDef) -> set[str]:
    names = {a.arg for a in ast.walk(function) if isinstance(a, ast.arg)}
    names |= {n.id for n in ast.walk(function) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return names


def function_identifiers(function: ast.FunctionDef) -> set[str]:
    """Every name the function uses as an identifier: variables and parameters (attributes and strings are not)."""
    names = {a.arg for a in ast.walk(function) if isinstance(a, ast.arg)}
    return names | {n.id for n in ast.walk(function) if isinstance(n, ast.Name)}


def rename(source: str, entry_point: str, old: str, new: str) -> str:
    """The code with `old` renamed `new` throughout the entry function (ast's layout), as a correct answer does."""
    tree = ast.parse(source)
    function = entry_function(tree, entry_point)
    assert function is not None
    for node in ast.walk(function):
        if isinstance(node, ast.Name) and node.id == old:
            node.id = new
        elif isinstance(node, ast.arg) and node.arg == old:
            node.arg = new
    return ast.unparse(tree) + "\n"


def _append_loop(node: ast.AST) -> bool:
    """A `for` statement whose body calls `.append` somewhere."""
    return isinstance(node, (ast.For, ast.AsyncFor)) and any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "append"
        for statement in node.body
        for n in ast.walk(statement)
    )


@dataclass(frozen=True)
class AppendLoop:
    """`NAME = []` then `for TARGET in ITER: [if COND:] NAME.append(ELEMENT)` (or an if and an else that both append,
    ELEMENT then a conditional expression): statements `index` and `index + 1`
    of `body`, a comprehension's worth."""

    body: list[ast.stmt]
    index: int
    name: str
    loop: ast.For
    element: ast.expr
    condition: ast.expr | None


def simple_append_loop(function: ast.FunctionDef) -> AppendLoop | None:
    """The function's one loop that appends, where it is a comprehension written out; None otherwise (no such loop,
    another loop that appends too, or a loop that does more than append)."""
    if sum(_append_loop(n) for n in ast.walk(function)) != 1:
        return None
    for node in ast.walk(function):
        for field in ("body", "orelse"):
            body = getattr(node, field, None)
            if not isinstance(body, list):
                continue
            for i, (first, second) in enumerate(itertools.pairwise(body)):
                found = _written_out(first, second)
                if found is not None:
                    return AppendLoop(body, i, *found)
    return None


def _written_out(first: ast.stmt, second: ast.stmt) -> tuple[str, ast.For, ast.expr, ast.expr | None] | None:
    if not (
        isinstance(first, ast.Assign)
        and len(first.targets) == 1
        and isinstance(first.targets[0], ast.Name)
        and _empty_list(first.value)
        and isinstance(second, ast.For)
        and not second.orelse
        and len(second.body) == 1
    ):
        return None
    name = first.targets[0].id
    statement = second.body[0]
    element = _appended(statement, name)
    if element is not None:
        return name, second, element, None
    if not isinstance(statement, ast.If) or len(statement.body) != 1:
        return None
    then = _appended(statement.body[0], name)
    if then is None:
        return None
    if not statement.orelse:  # if COND: NAME.append(A)  ->  [A for ... if COND]
        return name, second, then, statement.test
    otherwise = _appended(statement.orelse[0], name) if len(statement.orelse) == 1 else None
    if otherwise is None:
        return None
    # if COND: NAME.append(A) else: NAME.append(B)  ->  [A if COND else B for ...]
    return name, second, ast.IfExp(test=statement.test, body=then, orelse=otherwise), None


def _empty_list(value: ast.expr) -> bool:
    """`[]` or `list()`."""
    if isinstance(value, ast.List):
        return not value.elts
    return (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Name)
        and value.func.id == "list"
        and not (value.args or value.keywords)
    )


def _appended(statement: ast.stmt, name: str) -> ast.expr | None:
    """X where the statement is `NAME.append(X)`, else None."""
    if (
        isinstance(statement, ast.Expr)
        and isinstance(statement.value, ast.Call)
        and isinstance(statement.value.func, ast.Attribute)
        and statement.value.func.attr == "append"
        and isinstance(statement.value.func.value, ast.Name)
        and statement.value.func.value.id == name
        and len(statement.value.args) == 1
        and not statement.value.keywords
    ):
        return statement.value.args[0]
    return None


def to_comprehension(source: str, entry_point: str) -> str:
    """The code with its append loop written as a list comprehension (ast's layout), as a correct answer does."""
    tree = ast.parse(source)
    function = entry_function(tree, entry_point)
    assert function is not None
    found = simple_append_loop(function)
    assert found is not None
    generator = ast.comprehension(
        target=found.loop.target, iter=found.loop.iter, ifs=[found.condition] if found.condition else [], is_async=0
    )
    value = ast.ListComp(elt=found.element, generators=[generator])
    found.body[found.index : found.index + 2] = [ast.Assign(targets=[ast.Name(found.name, ast.Store())], value=value)]
    return ast.unparse(ast.fix_missing_locations(tree)) + "\n"


# ------------------------------------------------------------------------------------------ the tasks


def _code_task(kind: str, base: str, problem: Mapping[str, Any], code: str, instruction: str, **extra: Any) -> Task:
    return Task(
        key=derived_key(kind, base),
        source=EDIT_SOURCE,
        category=kind,
        turns=(f"{instruction} {REPLY}\n\n```python\n{code.rstrip()}\n```",),
        prefix=CODE_PREFIX,
        stop=CODE_STOP,
        extra={"kind": kind, "test": problem["test"], "entry_point": problem["entry_point"], "given": code, **extra},
    )


def edit_task(kind: str, problem: Mapping[str, Any]) -> Task | None:
    """The `kind` edit of a HumanEval problem (a dict of its data file), or None where the kind does not apply: fix
    where no bug can be injected that fails the tests, comprehension where no loop is a comprehension written out."""
    base = f"humaneval/{problem['task_id']}"
    key = derived_key(kind, base)
    entry = problem["entry_point"]
    source = solution_code(problem)
    function = entry_function(ast.parse(source), entry)
    if function is None:
        return None
    if kind == "edit_types":
        instruction = f"Add type hints to every parameter and the return value of `{entry}`, and a docstring."
        return _code_task(kind, base, problem, strip_types(source, entry), instruction)
    if kind == "edit_rename":
        names = rename_candidates(source, entry)
        if not names:
            return None
        old = names[_pick(key, len(names))]
        taken = function_identifiers(function) | {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)}
        first = _pick(key + "/new", len(NEW_NAMES))
        new = next(n for n in NEW_NAMES[first:] + NEW_NAMES[:first] if n not in taken)
        instruction = f"In `{entry}`, rename `{old}` to `{new}` everywhere it is used."
        return _code_task(kind, base, problem, source, instruction, old=old, new=new)
    if kind == "edit_fix":
        bugs = bug_candidates(source, entry, body_from=len(problem["prompt"]))
        bugs = [b for i, b in enumerate(bugs) if (problem["task_id"], i) not in EQUIVALENT_BUGS]
        if not bugs:
            return None
        bug = bugs[_pick(key, len(bugs))]
        instruction = f"The function `{entry}` has a bug: it fails its tests. Fix the bug."
        return _code_task(kind, base, problem, bug.apply(source), instruction, bug=bug.what)
    if kind == "edit_comprehension":
        if simple_append_loop(function) is None:
            return None
        instruction = f"In `{entry}`, replace the `for` loop that appends to a list with a list comprehension."
        return _code_task(kind, base, problem, source, instruction)
    raise ValueError(f"unknown edit kind {kind!r}")


# Bugs (task id, index among bug_candidates) that leave the problem's tests passing (the tests do not tell them
# from the solution): never injected. Found by running the bug each task would get against the tests until it failed
# them (tests/test_edit_tasks.py runs a sample of the injected bugs, and all of them with `-m real`).
EQUIVALENT_BUGS: frozenset[tuple[str, int]] = frozenset(
    (
        ("HumanEval/20", 1),
        ("HumanEval/24", 0),
        ("HumanEval/31", 0),
        ("HumanEval/32", 0),
        ("HumanEval/32", 1),
        ("HumanEval/35", 0),
        ("HumanEval/46", 0),
        ("HumanEval/75", 2),
        ("HumanEval/75", 3),
        ("HumanEval/81", 5),
        ("HumanEval/94", 3),
        ("HumanEval/109", 1),
        ("HumanEval/111", 0),
        ("HumanEval/111", 2),
        ("HumanEval/124", 6),
        ("HumanEval/124", 7),
        ("HumanEval/127", 2),
        ("HumanEval/127", 5),
        ("HumanEval/128", 0),
        ("HumanEval/135", 1),
        ("HumanEval/137", 1),
        ("HumanEval/140", 3),
        ("HumanEval/143", 1),
        ("HumanEval/145", 0),
        ("HumanEval/146", 0),
        ("HumanEval/148", 1),
        ("HumanEval/151", 0),
        ("HumanEval/159", 0),
    )
)


def edit_tasks(problems: Iterable[Mapping[str, Any]], kinds: Sequence[str] = EDIT_KINDS) -> list[Task]:
    """The edit tasks of `kinds` made from HumanEval problems, grouped by kind, each in the problems' order."""
    problems = list(problems)
    return [t for kind in kinds for p in problems if (t := edit_task(kind, p)) is not None]


def revise_task(question: Task) -> Task:
    """A two-turn chat: the question's first turn, then its answer asked for again, word for word, under a line."""
    key = derived_key(REVISE_CATEGORY, question.key)
    mark = REVISE_MARKS[_pick(key, len(REVISE_MARKS))]
    second = (
        f'Repeat your answer above exactly, word for word, but begin it with the line "{mark}". '
        "Write nothing else before or after it."
    )
    return Task(
        key=key,
        source=REVISE_SOURCE,
        category=REVISE_CATEGORY,
        turns=(question.turns[0], second),
        extra={"mark": mark},
    )


def revise_tasks(questions: Iterable[Task]) -> list[Task]:
    """A chat_revise task from every question, in order."""
    return [revise_task(q) for q in questions]


# ------------------------------------------------------------------------------------------- checks


def answer_code(text: str) -> str:
    """The code of an answer whose text began inside a ```python block: up to the block's end, if it has one."""
    return text.split("\n```", 1)[0].split("```", 1)[0] if "```" in text else text


def kind_problem(kind: str, code: str, extra: Mapping[str, Any]) -> str | None:
    """Why the code does not make the kind's change (None: it does); the tests are run apart from this."""
    try:
        tree = ast.parse(code)
    except SyntaxError as error:
        return f"not Python: {error.msg} (line {error.lineno})"
    function = entry_function(tree, extra["entry_point"])
    if function is None:
        return f"no function {extra['entry_point']}"
    if kind == "edit_types":
        if not _annotations_complete(function):
            return "a parameter or the return has no annotation"
        if ast.get_docstring(function) is None:
            return "no docstring"
    elif kind == "edit_rename":
        names = function_identifiers(function)
        if extra["old"] in names:
            return f"`{extra['old']}` is still there"
        if extra["new"] not in names:
            return f"no `{extra['new']}`"
    elif kind == "edit_comprehension":
        if any(_append_loop(n) for n in ast.walk(function)):
            return "a for loop still appends"
        if not any(isinstance(n, (ast.ListComp, ast.GeneratorExp, ast.SetComp)) for n in ast.walk(function)):
            return "no comprehension"
    return None


def check_edit(task: Task, text: str, timeout: float = 10.0, isolate: bool | None = True) -> ExecutionResult:
    """Whether an answer makes its task's edit: the kind's check, then the problem's tests run in the sandbox."""
    code = answer_code(text)
    problem = kind_problem(task.extra["kind"], code, task.extra)
    if problem is not None:
        return ExecutionResult(False, "failed", problem)
    program = f"{code}\n\n{task.extra['test']}\n\ncheck({task.extra['entry_point']})\n"
    return run_program(program, timeout=timeout, isolate=isolate)


_WORD = re.compile(r"\S+")


def revise_copy(first: str, second: str, mark: str, second_cut: bool = False) -> float:
    """How much of the first answer the second copied, 0..1: 0 unless the second begins with the asked-for line (on a
    line of its own or not; markdown emphasis, quotes and case aside), else the share of the first answer's words that
    the rest of the second holds in the same order (difflib's matching blocks). `second_cut`: the second answer ran
    out of its budget, so only as many of the first's words as it has count."""
    rest = _after_mark(second, mark)
    if rest is None:
        return 0.0
    want, got = _WORD.findall(first), _WORD.findall(rest)
    if second_cut:
        want = want[: len(got)]
    if not want:
        return 1.0 if not got else 0.0
    matcher = difflib.SequenceMatcher(None, want, got, autojunk=False)
    return sum(block.size for block in matcher.get_matching_blocks()) / len(want)


_DECORATION = "#*_\"' \t\n"


def _after_mark(text: str, mark: str) -> str | None:
    """The text after its leading `mark`, or None when it does not begin with it."""
    text, mark = text.lstrip(_DECORATION), mark.strip().rstrip(":")
    if not text.lower().startswith(mark.lower()):
        return None
    return text[len(mark) :].lstrip(":" + _DECORATION)
