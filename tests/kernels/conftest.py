"""Kernel tests run on CUDA directly, and on CPU only under the Triton interpreter.

TRITON_INTERPRET=1 is read when a kernel is decorated (at import), so it cannot be switched on
inside this process without leaking into every other test directory. On CPU,
test_interpreter.py starts one child pytest over this directory with the variable set; in the
parent the same tests skip.
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _skip_repatching_on_device_calls() -> None:
    """Triton's interpreter (3.9) re-patches triton.language, walking every module member with
    inspect.getmembers, on each call of a @triton.jit helper from inside a kernel, although the
    launch running the kernel has patched those modules already (and restores them when its grid
    ends). For kernels built from shared helpers that is over half of the interpreted suite's time.
    Here a helper call patches only the language modules (tl, tl.core) that this launch has not
    patched yet, then runs the same rewritten code. Where the interpreter's internals differ from
    what this expects, nothing is changed."""
    import triton.language as tl
    from triton.runtime import interpreter

    device_fn = getattr(interpreter, "InterpretedFunction", None)
    grid = getattr(interpreter, "GridExecutor", None)
    error = getattr(interpreter, "InterpreterError", None)
    patch_lang = getattr(interpreter, "_patch_lang", None)
    if None in (device_fn, grid, error, patch_lang) or not hasattr(device_fn, "rewrite"):
        return
    patched: set[int] = set()  # ids of the language modules the running launch has patched

    def langs(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}

    launch = grid.__call__

    def grid_call(self, *args, **kwargs):
        patched.clear()
        patched.update(langs(self.fn))
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.clear()

    def device_call(self, *args, **kwargs):
        needed = langs(self.fn)
        if not needed <= patched:
            patch_lang(self.fn)
            patched.update(needed)
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as e:
            raise error(repr(e)) from e

    grid.__call__ = grid_call
    device_fn.__call__ = device_call


def _round_like_the_gpu() -> None:
    """Triton's interpreter (3.9) narrows floats to the formats numpy lacks (fp8, bf16) by truncating
    the mantissa and adding its first dropped bit without carrying into the exponent: 0.4857 becomes
    0.25 in E4M3, not 0.5 (one value in ~30 of a normal distribution lands on such a carry), and ties
    round up. The GPU's cvt rounds to nearest even. Here fp32 / fp16 / bf16 -> E4M3 / E5M2 / bf16
    go through torch's conversions (round to nearest even) instead; every other conversion keeps
    the interpreter's."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    convert = getattr(interpreter, "_convert_float", None)
    if convert is None:
        return
    targets = {tl.float8e4nv: (torch.float8_e4m3fn, torch.uint8), tl.float8e5: (torch.float8_e5m2, torch.uint8),
               tl.bfloat16: (torch.bfloat16, torch.int16)}
    sources = {tl.float32: (np.float32, None), tl.float16: (np.float16, None), tl.bfloat16: (np.uint16, torch.bfloat16)}

    def convert_float(input, input_dtype, output_dtype, rounding_mode):
        if output_dtype not in targets or input_dtype not in sources or input_dtype == output_dtype:
            return convert(input, input_dtype, output_dtype, rounding_mode)
        np_dtype, torch_view = sources[input_dtype]
        x = torch.from_numpy(np.ascontiguousarray(input).view(np_dtype).copy())
        if torch_view is not None:
            x = x.view(torch_view)
        target, bits = targets[output_dtype]
        out = x.to(target).view(bits).numpy().reshape(input.shape)
        return out.view(np.uint16) if bits == torch.int16 else out

    interpreter._convert_float = convert_float


def _widen_bf16_dot_operands() -> None:
    """Triton's interpreter (3.9) keeps bf16 tensors as their uint16 bits (numpy has no bf16) and
    hands them to np.matmul as they are: a tl.dot of bf16 operands multiplies integers. Here bf16
    operands are widened to float32 first (exact: a bf16 is the top half of a float32), as the
    tensor cores read them."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    handle = getattr(interpreter, "TensorHandle", None)
    if builder is None or handle is None or not hasattr(builder, "create_dot"):
        return
    create_dot = builder.create_dot

    def widened(t):
        if t.dtype.scalar != tl.bfloat16:
            return t
        bits = np.ascontiguousarray(t.data).view(np.uint16).astype(np.uint32) << 16
        return handle(bits.view(np.float32), tl.float32)

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = dot


def _xor_reductions_in_numpy() -> None:
    """Triton's interpreter (3.9) has numpy paths for sum / min / max / argmin / argmax reductions;
    any other combine function it runs element by element in Python, calling the combine function
    once per element. tl.sort is a bitonic network whose every compare-and-swap step is an xor_sum
    over an axis of 2: for moe_align.py's 256-key sort that was ~0.3 s a program, a fifth of the
    interpreted suite's time (now ~0.03 s). Here xor reductions take np.bitwise_xor.reduce (exact: integer xor
    is associative and commutative); every other combine function keeps the interpreter's path."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    ops = getattr(interpreter, "ReduceOps", None)
    xor = getattr(tl.standard, "_xor_combine", None)
    if ops is None or xor is None or not hasattr(ops, "to_tensor"):
        return
    apply_impl = ops.apply_impl

    def xor_in_numpy(self, input):
        if self.combine_fn is not xor or len(input) != 1:
            return apply_impl(self, input)
        x = input[0]
        out = np.bitwise_xor.reduce(x.handle.data, axis=self.axis, keepdims=self.keep_dims)
        return self.to_tensor(out, x.dtype)

    ops.apply_impl = xor_in_numpy


def _np_dtypes_looked_up_once() -> None:
    """Triton's interpreter (3.9) maps a Triton dtype to its numpy storage dtype (_get_np_dtype) by
    building a dict of all nineteen scalar types on every call, ~10 us each, several times for every
    op of every program: ~7% of the unified attention kernel's interpreted time. Here each dtype's answer is kept after
    its first lookup (the map is constant)."""
    import triton.language as tl
    from triton.runtime import interpreter

    lookup = getattr(interpreter, "_get_np_dtype", None)
    if lookup is None:
        return
    known: dict = {}

    def np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):  # (unhashable) its elements' answer, as the original gives
            tt_dtype = tt_dtype.element_ty
        try:
            return known[tt_dtype]
        except KeyError:
            known[tt_dtype] = value = lookup(tt_dtype)
            return value
        except TypeError:  # an unhashable type
            return lookup(tt_dtype)

    interpreter._get_np_dtype = np_dtype


if INTERPRETED:
    _np_dtypes_looked_up_once()
    _skip_repatching_on_device_calls()
    _round_like_the_gpu()
    _widen_bf16_dot_operands()
    _xor_reductions_in_numpy()


@pytest.fixture
def kernel_device() -> torch.device:
    if torch.cuda.is_available() and not INTERPRETED:
        return torch.device("cuda")
    if INTERPRETED:
        return torch.device("cpu")
    pytest.skip("Triton kernels on CPU run in the interpreter child started by test_interpreter.py")


@pytest.fixture
def seed() -> int:
    """Fresh random inputs every run; the seed is printed so a failure can be replayed."""
    value = int(os.environ.get("FERROX_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    torch.manual_seed(value)
    print(f"seed={value} (replay with FERROX_TEST_SEED={value})")
    return value


@pytest.fixture
def cuda_device() -> torch.device:
    """For @pytest.mark.gpu tests at real shapes."""
    if not torch.cuda.is_available() or INTERPRETED:
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda")


def pytest_collection_modifyitems(config, items):
    """In test_interpreter.py's child, run only the tests that skip in the parent pytest (those taking
    `kernel_device`): the rest (pure torch, CUDA sources compiled by NVRTC, the graph ladders) ran natively
    there already, and ran again here for ~30 s of the CI box's time."""
    if os.environ.get("FERROX_INTERPRETER_CHILD") != "1":
        return
    here = os.path.dirname(os.path.abspath(__file__))
    keep, dropped = [], []
    for item in items:
        native = str(item.path).startswith(here) and "kernel_device" not in getattr(item, "fixturenames", ())
        (dropped if native else keep).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
