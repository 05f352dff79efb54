"""torch's weight-only kernels are never handed operands they would crash on or misread: what a copy makes acceptable
is copied, what none does is refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

# Each case in a process of its own: without the checks, torch's kernel kills the process (SIGSEGV) or reads past
# the rows. A case prints its outcome; the process's exit status says whether the last one it started crashed.
_CASES = textwrap.dedent(
    """
    import json, sys, torch
    from torch import nn
    from viasd.errors import ViasdError
    from viasd.views.linears import Int4WeightOnlyLinear, Int8WeightOnlyLinear

    def off_boundary(tensor, offset=8):
        # `tensor` 8 bytes past a 64-byte boundary, as a tensor mapped from a file safetensors wrote lies.
        raw = tensor.reshape(-1).view(torch.uint8)
        room = torch.empty(raw.numel() + 64, dtype=torch.uint8)
        start = (-room.data_ptr()) % 64 + offset
        room[start : start + raw.numel()] = raw
        return room[start : start + raw.numel()].view(tensor.dtype).view(tensor.shape)

    def outcome(run):
        try:
            run()
        except ViasdError as error:
            return "refused: " + str(error)
        return "computed"

    torch.manual_seed(0)
    case = sys.argv[1]
    if case == "int8wo off boundary":
        layer = Int8WeightOnlyLinear.from_linear(nn.Linear(576, 64).to(torch.bfloat16))
        x = torch.randn(3, 576, dtype=torch.bfloat16)
        want = layer(x)
        layer.weight = off_boundary(layer.weight.clone())
        print(json.dumps(bool(torch.equal(layer(off_boundary(x)), want))))
    elif case == "int8wo rows of 68":
        layer = Int8WeightOnlyLinear.from_linear(nn.Linear(576, 64).to(torch.bfloat16))
        layer.weight = torch.randint(-127, 128, (64, 68), dtype=torch.int8)  # a copy of other shapes
        print(json.dumps(outcome(lambda: layer(torch.randn(3, 68, dtype=torch.bfloat16)))))
    elif case == "int8wo made of rows of 68":
        print(json.dumps(outcome(lambda: Int8WeightOnlyLinear.from_linear(nn.Linear(68, 32)))))
    elif case == "int4 scales strided":
        layer = Int4WeightOnlyLinear.from_linear(nn.Linear(256, 64).to(torch.bfloat16))
        x = torch.randn(3, 256, dtype=torch.bfloat16)
        want = layer(x)
        layer.scales_zeros = layer.scales_zeros.transpose(0, 1).contiguous().transpose(0, 1)  # same values, strided
        print(json.dumps(bool(torch.equal(layer(x), want))))
    elif case == "int4 scales of another length":
        layer = Int4WeightOnlyLinear.from_linear(nn.Linear(256, 64).to(torch.bfloat16))
        layer.scales_zeros = layer.scales_zeros[:2]
        print(json.dumps(outcome(lambda: layer(torch.randn(3, 256, dtype=torch.bfloat16)))))
    """
)


@pytest.mark.parametrize(
    ("case", "want"),
    [
        ("int8wo off boundary", True),  # copies mapped from a file, activations a view into another tensor
        ("int8wo rows of 68", "refused: torch's int8 weight-only product cannot take these operands: 68 input"),
        ("int8wo made of rows of 68", "refused: int8wo: 68 input features are not a multiple of 16"),
        ("int4 scales strided", True),
        ("int4 scales of another length", "refused: torch's int4 weight-only product cannot take these operands:"),
    ],
)
def test_torch_kernels_are_never_handed_operands_they_crash_on(case: str, want: bool | str) -> None:
    run = subprocess.run([sys.executable, "-c", _CASES, case], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"{case}: exit status {run.returncode}\n{run.stderr[-2000:]}"
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got == want if isinstance(want, bool) else (isinstance(got, str) and got.startswith(want)), got
