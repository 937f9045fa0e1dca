"""Vendor Megatron-LM's functional-test flags and H100 memory golden values for remat's dev cases.

Reads a local git copy of NVIDIA/Megatron-LM (no network) at one commit and writes
``benchmarks/data/megatron_golden_h100_dev.json``: for each case of ``--cases`` (one ``<family>/<case>`` a line),
its ``model_config.yaml`` (MODEL_ARGS, ENV_VARS, TEST_TYPE), the world size (the case's own ``MODEL_ENV_VARS``
GPUS_PER_NODE, else ``tests/test_utils/recipes/h100/<family>.yaml``'s nodes x gpus) and, per iteration,
``mem-max-allocated-bytes`` and ``mem-allocated-bytes`` of ``golden_values_dev_dgx_h100.json``, each with its
source path. Only these dev cases are vendored: the rest of the corpus and the other GPUs' values are a held-out check.

    python benchmarks/vendor_megatron_golden.py --repo /path/to/Megatron-LM/.git \
        --commit d98e8a64ddf34856e74b24714e3bedb2f5a39553 --cases ../shared/golden/megatron_h100_dev_cases.txt
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import yaml

OUT = Path(__file__).parent / "data" / "megatron_golden_h100_dev.json"
METRICS = ("mem-max-allocated-bytes", "mem-allocated-bytes")


def git_show(repo: str, commit: str, path: str) -> str:
    return subprocess.run(["git", "--git-dir", repo, "show", f"{commit}:{path}"], check=True,
                          capture_output=True, text=True).stdout


def world_size(repo: str, commit: str, family: str) -> int:
    spec = yaml.safe_load(git_show(repo, commit, f"tests/test_utils/recipes/h100/{family}.yaml"))["spec"]
    return int(spec["nodes"]) * int(spec["gpus"])


def vendor_case(repo: str, commit: str, name: str, sizes: dict[str, int]) -> dict:
    family, case = name.split("/")
    base = f"tests/functional_tests/test_cases/{family}/{case}"
    config = yaml.safe_load(git_show(repo, commit, f"{base}/model_config.yaml"))
    golden = json.loads(git_show(repo, commit, f"{base}/golden_values_dev_dgx_h100.json"))
    if family not in sizes:
        sizes[family] = world_size(repo, commit, family)
    values = {m: {it: int(v) for it, v in golden[m]["values"].items() if v == v} for m in METRICS if m in golden}
    # run_ci_test.sh: a checkpoint-consistency test runs each MODEL_ARGS* key on MODEL_ENV_VARS.<key>.GPUS_PER_NODE
    # GPUs of one node; MODEL_ARGS is the first run's
    gpus = ((config.get("MODEL_ENV_VARS") or {}).get("MODEL_ARGS") or {}).get("GPUS_PER_NODE")
    return {
        "case": name,
        "model_config": f"{base}/model_config.yaml",
        "golden_values": f"{base}/golden_values_dev_dgx_h100.json",
        "recipe": f"tests/test_utils/recipes/h100/{family}.yaml",
        "world_size": int(gpus) if gpus is not None else sizes[family],
        "test_type": config.get("TEST_TYPE", "regular"),
        "env": {k: str(v) for k, v in (config.get("ENV_VARS") or {}).items()},
        "model_args": {k: v for k, v in config["MODEL_ARGS"].items()},
        "golden": values,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", required=True, help="Megatron-LM's git directory")
    parser.add_argument("--commit", required=True)
    parser.add_argument("--cases", required=True, help="file of <family>/<case> lines")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    names = [line.strip() for line in Path(args.cases).read_text().splitlines() if line.strip()]
    sizes: dict[str, int] = {}
    data = {"source": "https://github.com/NVIDIA/Megatron-LM", "commit": args.commit, "gpu": "DGX H100",
            "cases": [vendor_case(args.repo, args.commit, n, sizes) for n in names]}
    Path(args.out).write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    print(f"wrote {len(names)} cases to {args.out}")


if __name__ == "__main__":
    main()
