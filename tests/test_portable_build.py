"""The kernels in their portable C only, as a compiler without GCC's vector types and x86 target
attributes would build them (setup.py with LLMCTL_PORTABLE=1: LLMCTL_NO_AVX_DISPATCH,
ATT_NO_DISPATCH, ATT_NO_VEC): no AVX copy of any kernel, and the attention's scalar set. The kernel
tests run again in a child against that build (tests/variant_build.py). The scalar attention set
is in the "default" result class, so it must give test_attention.py's pinned "default" bits: the
bit-level contract of attention_kernels.h, checked where the vector sets are not compiled at all.
"""
import pytest
from variant_build import ISA_EXTS, build, child_python, run_kernel_tests


@pytest.fixture(scope="module")
def portable_build(tmp_path_factory):
    return build(tmp_path_factory.mktemp("portable"), {"LLMCTL_PORTABLE": "1"}, exts=ISA_EXTS)


@pytest.mark.slow
def test_portable_kernels_pass_the_kernel_tests(portable_build, tmp_path):
    out = child_python(portable_build, "from llmctl._ext import adamw, attention, buildinfo, kvcache, layers, matmul; "
                       "print(buildinfo.portable(), attention.available_isas(), attention.isa_info()['vector_width'], "
                       "layers.simd(), adamw.simd(), kvcache.isa(), matmul.gemv_bf16_isas(), "
                       "attention.bf16_available_paths())", tmp_path)
    assert out.split() == ["True", "['default']", "1", "baseline", "baseline", "baseline", "()", "['emulated']"], out
    r, passed, skipped = run_kernel_tests(portable_build, tmp_path / "junit.xml")
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    for want in ("test_attention::test_fp32_attention_bits_are_pinned[default]",
                 "test_attention::test_forward_matches_reference[default-1-300-64-1-2]",
                 "test_attention::test_backward_finite_differences[default-2]",
                 "test_sample::test_attention_cached_kernel_matches_numpy[baseline-2-9-2-64-2-103]"):
        assert any(want in n for n in passed), (want, sorted(n for n in skipped if want.split("::")[0] in n))
