"""llmctl/roof.py: MFU's roof is the best GEMM measurement cached per CPU (model, features),
threads, GEMM engine and precision. Measurements are injected: nothing here is timed."""
import json
import os

from llmctl import roof

CPU = ("Test CPU @ 2.0GHz", "0123abcd4567")


def test_the_key_tells_apart_cpu_features_engine_precision_and_threads():
    base = roof.roof_key(2, "fp32", CPU, "dnnl")
    assert roof.roof_key(2, "fp32", CPU, "dnnl") == base
    others = [roof.roof_key(2, "fp32", ("Other CPU", CPU[1]), "dnnl"),
              roof.roof_key(2, "fp32", (CPU[0], "ffff00001111"), "dnnl"),
              roof.roof_key(2, "fp32", CPU, "blas"),
              roof.roof_key(2, "bf16", CPU, "dnnl"),
              roof.roof_key(1, "fp32", CPU, "dnnl")]
    assert len({base, *others}) == 6


def test_cpu_identity_is_the_model_name_and_a_hash_of_the_flags_in_any_order(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu avx2 avx512f\n\n"
                 "processor\t: 1\nmodel name\t: Some CPU\nflags\t\t: fpu avx2 avx512f\n")
    b.write_text("processor\t: 0\nflags\t\t: avx512f fpu avx2\nmodel name\t: Some CPU\n")
    assert roof.cpu_identity(str(a)) == roof.cpu_identity(str(b))
    assert roof.cpu_identity(str(a))[0] == "Some CPU"
    b.write_text("processor\t: 0\nflags\t\t: fpu avx2\nmodel name\t: Some CPU\n")
    assert roof.cpu_identity(str(a))[1] != roof.cpu_identity(str(b))[1]


def test_the_roof_is_the_best_measurement_so_far_and_the_cache_keeps_it(tmp_path):
    """Start-up timings of 151, 379, 200 GFLOP/s (one machine, three runs): the roof rises to the
    best and stays there; another thread count has its own roof."""
    path = str(tmp_path / "cache" / roof.ROOF_FILE)  # the directory is created
    got = [roof.best_roof(m, 2, "fp32", CPU, "dnnl", path) for m in (151e9, 379e9, 200e9)]
    assert [g[0] for g in got] == [151e9, 379e9, 379e9]
    assert got[0][1] == f"measured now, the first on this CPU at 2 threads; cached in {path}"
    assert got[2][1] == f"best of 3 measurements on this CPU at 2 threads, cached in {path}"
    assert roof.best_roof(50e9, 1, "fp32", CPU, "dnnl", path)[0] == 50e9
    roofs = json.loads(open(path).read())["roofs"]
    assert {e["threads"]: (e["flops"], e["measurements"]) for e in roofs.values()} == \
        {2: (379e9, 3), 1: (50e9, 1)}
    assert os.listdir(tmp_path / "cache") == [roof.ROOF_FILE]  # written by rename: no temp left
    listed = roof.cached_roofs(CPU, "dnnl", path)
    assert [(e["precision"], e["threads"], e["flops"]) for e in listed] == \
        [("fp32", 1, 50e9), ("fp32", 2, 379e9)]
    assert roof.cached_roofs(("Other CPU", CPU[1]), "dnnl", path) == []
    assert roof.cached_roofs(CPU, "blas", path) == []


def test_a_damaged_cache_is_replaced_and_an_unwritable_one_costs_only_the_caching(tmp_path):
    path = tmp_path / roof.ROOF_FILE
    for junk in ("{not json", '{"roofs": [1, 2]}', '{"roofs": {"k": {"flops": "fast"}}}'):
        path.write_text(junk)
        assert roof.best_roof(100e9, 2, "fp32", CPU, "dnnl", str(path))[0] == 100e9
        assert roof.cached_roofs(CPU, "dnnl", str(path))[0]["flops"] == 100e9
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    flops, source = roof.best_roof(120e9, 2, "fp32", CPU, "dnnl", str(blocker / roof.ROOF_FILE))
    assert flops == 120e9 and source.startswith("measured now; not cached (")
