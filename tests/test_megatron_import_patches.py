"""slime.patches.megatron_core.import_megatron (torch.compile at a decorated function's first call, not at import,
and only under --fused-kernels compile) and apply_in_process_save_results (a synchronous save's results through a
plain queue)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from slime.models import fused_kernels
from slime.patches import megatron_core

ROOT = Path(__file__).resolve().parents[1]


def test_a_decorated_function_is_compiled_at_its_first_call_once_with_torch_s_compile(monkeypatch):
    monkeypatch.setattr(fused_kernels, "active", lambda: "compile")  # --fused-kernels compile
    compiled = []

    def compile_now(fn=None, **options):
        compiled.append((fn, options))
        return lambda *args: fn(*args) + 1 if fn is not None else None

    compile_later = megatron_core._compile_at_first_call(compile_now)

    def scaled(x):
        return 2 * x

    wrapped = compile_later(scaled)
    assert compiled == [] and wrapped.__wrapped__ is scaled and wrapped.__name__ == "scaled"
    assert wrapped(3) == 7 and wrapped(4) == 9  # the compiled function answers
    assert compiled == [(scaled, {})]  # compiled once, at the first call
    module = torch.nn.Linear(2, 2)
    compile_later(module)  # a module, or options for a decorator: torch.compile's own way, now
    compile_later(mode="max-autotune")
    assert compiled[1:] == [(module, {}), (None, {"mode": "max-autotune"})]


def test_under_eager_fused_kernels_a_decorated_function_runs_as_written_and_nothing_is_compiled(monkeypatch):
    """--fused-kernels eager (CPU's default under auto): megatron's fused functions (the gated attention's output
    gate) are the unfused reference too, with no inductor C++ kernel built in every rank."""
    monkeypatch.setattr(fused_kernels, "active", lambda: "eager")
    compiled = []

    def compile_now(fn=None, **options):
        compiled.append(fn)
        return lambda *args: fn(*args) + 1

    def scaled(x):
        return 2 * x

    wrapped = megatron_core._compile_at_first_call(compile_now)(scaled)
    assert wrapped(3) == 6 and wrapped(4) == 8 and compiled == []


def test_megatron_and_the_actor_imported_through_the_patch_pull_in_no_dynamo_and_the_fusions_still_compute():
    """In a fresh interpreter (the test process has megatron imported already)."""
    script = (
        "import sys, torch\n"
        "from slime.patches.megatron_core import import_megatron\n"
        "import_megatron()\n"
        "import slime.backends.megatron_utils.actor\n"
        "from megatron.core.fusions.fused_bias_swiglu import bias_swiglu\n"
        "assert 'torch._inductor.lowering' not in sys.modules, 'inductor imported'\n"
        "assert 'torch._dynamo' not in sys.modules, 'dynamo imported'\n"
        "assert torch.compile.__module__ == 'torch', 'torch.compile left patched'\n"
        "x, b = torch.randn(4, 6), torch.randn(6)\n"
        "y = x + b\n"
        "a, g = y.chunk(2, -1)\n"
        "assert torch.allclose(bias_swiglu.__wrapped__(x, b), torch.nn.functional.silu(a) * g)\n"
        "print('ok')\n")
    # an import of megatron-core and torch in a fresh process: about 20 s alone, over 120 s on two loaded cores
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_the_save_s_results_queue_is_in_process():
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    megatron_core.apply_in_process_save_results()
    results = filesystem_async._get_write_results_queue()
    results.put({"rank": 0})
    assert results.get_nowait() == {"rank": 0}
    assert results is not filesystem_async._get_write_results_queue()  # one per save, no process behind it
