"""The kernels' AVX-512 copies, run on any x86-64 CPU with AVX2 and FMA.

setup.py with LLMCTL_SIMDE_AVX512=1 compiles the extensions against SIMDe's portable forms of the
AVX-512 intrinsics (the simde-py package's headers, through _ext/simde_avx512.h): no AVX-512
instruction is emitted, and the run-time dispatch picks the AVX-512 copies. The kernel tests that
are parametrised over instruction sets then run again in a child pytest against that build,
where their "avx512", "avx512_bf16" and "amx" cases no longer skip.

What this checks: each AVX-512, AVX512_BF16 and AMX copy's loops, masks, tails, gathers, scatters,
tile shapes and dispatch, against the same references and pinned bits as the native copies (the
fp32 attention's AVX-512 set must give test_attention.py's pinned bits, the bf16 GEMV's
AVX512_BF16 copy the NumPy model's). What it cannot: the instructions' own results come from
SIMDe's definitions, and vdpbf16ps's and the tiles' from the Intel SDM's (simde_avx512.h), not
from hardware. The build and the child run are
tests/variant_build.py's.
"""
import platform
import re

import pytest
from conftest import require
from variant_build import ISA_EXTS, build, child_python, run_kernel_tests


def _skip_reason():
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"the AVX-512 copies exist on x86-64 only; this is {platform.machine()}"
    try:
        import simde_py  # noqa: F401
    except ImportError:
        require(False, "simde-py is not installed (pip install '.[test]' brings it)")
    from llmctl._ext import attention
    if "avx2" not in attention.available_isas():
        return "the emulated build needs AVX2 and FMA, which this CPU lacks"
    return None


@pytest.fixture(scope="module")
def emulated_build(tmp_path_factory):
    why = _skip_reason()
    if why:
        pytest.skip(why)
    # every extension with AVX-512 copies (rows.h alone is in four), and buildinfo, which says
    # which build this is
    return build(tmp_path_factory.mktemp("simde"), {"LLMCTL_SIMDE_AVX512": "1"}, exts=ISA_EXTS)


@pytest.mark.slow
def test_avx512_copies_pass_the_kernel_tests_emulated(emulated_build, tmp_path):
    out = child_python(emulated_build, "from llmctl._ext import attention, buildinfo; "
                       "print(attention.__file__, buildinfo.simde_avx512(), attention.isa())", tmp_path)
    assert out.startswith(str(emulated_build)) and out.split()[1:] == ["True", "avx512"], out
    r, passed, skipped = run_kernel_tests(emulated_build, tmp_path / "junit.xml")
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    # the AVX-512 cases really ran, in every module that has them, instead of skipping for want
    # of the CPU (the row-loop test runs every level of buildinfo's build in one case)
    for want in (r"test_attention::test_fp32_attention_bits_are_pinned\[avx512\]",
                 r"test_attention::test_forward_matches_reference\[avx512-",
                 r"test_attention::test_backward_matches_reference\[avx512-",
                 r"test_attention_bf16::test_matches_bf16_rounded_reference\[avx512_bf16-",
                 r"test_attention_bf16::test_matches_bf16_rounded_reference\[amx-",
                 r"test_bf16::test_gemv_copies_give_vdpbf16ps_bits\[.*-avx512_bf16\]",
                 r"test_sample::test_attention_cached_kernel_matches_numpy\[avx512-",
                 r"test_sample::test_attention_cached_prefix_gives_the_bits_of_one_cache\[avx512-",
                 r"test_sample::test_attention_cached_query_gives_the_bits_of_itself_alone\[avx512-",
                 r"test_sample::test_decode_step_in_one_call_gives_the_bits_of_the_layer_loop\[avx512_bf16-",
                 r"test_kernels::test_row_loops_give_identical_bits_in_every_instruction_set\["):
        assert any(re.search(want, n) for n in passed), (want, sorted(n for n in skipped if want.split("::")[0] in n))
