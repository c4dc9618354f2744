"""Small Hugging Face datasets in a real `datasets` cache, for tests that run offline.

`cached_hub_dataset` writes the rows as jsonl files of a local dataset repository (a README.md
`configs:` block, as the Hub repositories have), lets the `datasets` library itself build that
repository into the cache (`load_dataset_builder(...).download_and_prepare()`: arrow files and
dataset_info.json), and files the result under the name `datasets` gives a Hub dataset,
`{namespace}___{name}/{config}/{version}/{hash}` (the `namespace___` prefix is what datasets'
`DatasetBuilder._relative_data_dir` adds for a repo id). With HF_DATASETS_OFFLINE=1,
`datasets.load_dataset("namespace/name", ...)` then reads it exactly as a dataset downloaded
from the Hub before, streaming or not.
"""
import json
import os
import shutil
import tempfile
from pathlib import Path



def empty_datasets_cache(tmp_path, monkeypatch):
    """Point the `datasets` library at a new, empty cache under tmp_path, offline (the body of
    the tests' `datasets_cache` fixture); returns its path."""
    import datasets

    cache = tmp_path / "hf_datasets_cache"
    cache.mkdir()
    # datasets reads these from the environment once, at import: point the library at them
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    return cache


def cached_hub_dataset(cache, repo_id, splits, config=None):
    """Put `splits` ({split: [row dict, ...]}) into the datasets cache `cache` as Hub dataset
    `repo_id` (config `config`, or the default one)."""
    import datasets

    namespace, name = repo_id.split("/")
    repos = Path(cache).parent / "hf_dataset_repos"
    repos.mkdir(exist_ok=True)
    repo = Path(tempfile.mkdtemp(dir=repos)) / name  # the builder names the dataset after the directory
    (repo / "data").mkdir(parents=True)
    card = ["---", "configs:", f"- config_name: {config or 'default'}", "  data_files:"]
    for split, rows in splits.items():
        with open(repo / "data" / f"{split}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        card += [f"  - split: {split}", f"    path: data/{split}.jsonl"]
    (repo / "README.md").write_text("\n".join(card + ["---", ""]), encoding="utf-8")

    builder = datasets.load_dataset_builder(str(repo), name=config, cache_dir=str(cache))
    builder.download_and_prepare()
    local = Path(cache) / builder.dataset_name
    hub = Path(cache) / f"{namespace}___{builder.dataset_name}"
    for cfg in os.listdir(local):
        if (local / cfg).is_dir():
            hub.mkdir(exist_ok=True)
            shutil.move(str(local / cfg), str(hub / cfg))
    shutil.rmtree(local)
    return hub
