"""Downloads a Hugging Face Hub model repo into a folder, once (the chart's init containers).

    python fetch_model.py --repo ORG/NAME --revision main --dest /models/NAME [--tokenizer-only]

A marker file in the folder records what was downloaded (repo, revision, whole or tokenizer
only); when it matches, nothing is fetched, so a restarted pod starts at once and works
without the Hub. A token for gated repos comes from HF_TOKEN.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

MARKER = ".radixserve-download.json"
# What a tokenizer (and the chat template, generation config) needs, never the weights.
TOKENIZER_PATTERNS = ["*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja", "tokenizer*"]


def wanted(args: argparse.Namespace) -> dict[str, object]:
    return {"repo": args.repo, "revision": args.revision, "tokenizer_only": args.tokenizer_only}


def already_there(dest: Path, want: dict[str, object]) -> bool:
    """The folder holds this repo at this revision, whole or (if that is all we need) in part."""
    try:
        have = json.loads((dest / MARKER).read_text())
    except (OSError, ValueError):
        return False
    same = have.get("repo") == want["repo"] and have.get("revision") == want["revision"]
    return same and (want["tokenizer_only"] or not have.get("tokenizer_only"))


def download(args: argparse.Namespace, dest: Path) -> None:
    from huggingface_hub import snapshot_download

    snapshot_download(
        repo_id=args.repo,
        revision=args.revision,
        local_dir=str(dest),
        allow_patterns=TOKENIZER_PATTERNS if args.tokenizer_only else None,
        token=os.environ.get("HF_TOKEN") or None,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", required=True)
    parser.add_argument("--revision", default="main")
    parser.add_argument("--dest", required=True)
    parser.add_argument("--tokenizer-only", action="store_true")
    args = parser.parse_args(argv)
    dest, want = Path(args.dest), wanted(args)
    if already_there(dest, want):
        print(f"{args.repo}@{args.revision} already in {dest}: nothing to download")
        return 0
    dest.mkdir(parents=True, exist_ok=True)
    what = "tokenizer of " if args.tokenizer_only else ""
    print(f"downloading {what}{args.repo}@{args.revision} into {dest}", flush=True)
    download(args, dest)
    (dest / MARKER).write_text(json.dumps(want))  # last: an interrupted download is redone
    print("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
