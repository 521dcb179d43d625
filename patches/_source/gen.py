"""Regenerate patches/<pin>/ from the edit specs here, applied to a pristine unpacked wheel.

    SGLANG_SRC=/tmp/src python3 patches/_source/gen.py 0.5.19     # needs $SGLANG_SRC/<pin>/sglang

Each spec (spec_<pin>.py) lists patches as (name, header, [(file, anchor, replacement)]); an anchor must
occur exactly once. The code blocks and headers shared by the pins live in common_text.py (and lifecycle_text.py,
commit_checks_text.py, side_channels_text.py); the new module
of the notification patch is pd_rejections.py. Do not edit the generated .patch files by hand.
"""
from __future__ import annotations

import difflib
import importlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = Path(os.environ.get("SGLANG_SRC", "/tmp/src"))
OUT = HERE.parent
AUTHOR = "sglang-harden <sglang-harden@localhost>"
DATE = "Thu, 1 Jan 2026 00:00:00 +0000"


def apply_edit(root: Path, rel: str, old: str | None, new: str) -> None:
    path = root / rel
    if old is None:  # new file
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(new)
        return
    text = path.read_text()
    n = text.count(old)
    if n != 1:
        raise SystemExit(f"{rel}: anchor found {n} times:\n{old}")
    path.write_text(text.replace(old, new, 1))


def diff_file(before: Path, after: Path, rel: str) -> str:
    a = before.read_text().splitlines(keepends=True) if before.exists() else []
    b = after.read_text().splitlines(keepends=True)
    fa = f"a/{rel}" if before.exists() else "/dev/null"
    out = "".join(difflib.unified_diff(a, b, fa, f"b/{rel}", n=3))
    if b and not b[-1].endswith("\n"):
        raise SystemExit(f"{rel}: no final newline")
    return out


def mail_header(header: str, idx: int, total: int) -> str:
    """The patch's header as one mail of a ``git format-patch`` series (so ``git am`` takes it; ``patch -p1``
    skips it): fixed sender and date so that the files are reproducible, the header's first line as subject,
    the rest as the commit message, ``---`` before the diff."""
    subject, _, message = header.strip().partition("\n")
    return (f"From {'0' * 40} Mon Sep 17 00:00:00 2001\n"
            f"From: {AUTHOR}\n"
            f"Date: {DATE}\n"
            f"Subject: [PATCH {idx}/{total}] {subject.strip()}\n"
            f"\n{message.strip()}\n---\n")


def main(pin: str, src_root: Path | None = None, out_root: Path = OUT) -> None:
    """Write ``out_root/<pin>/`` from the spec, against the pristine tree ``src_root`` (the directory that
    holds ``sglang/``; default ``$SGLANG_SRC/<pin>``). Only the files the spec edits are read."""
    spec = importlib.import_module("spec_" + pin.replace(".", "_"))
    src_root = src_root or SRC / pin
    if not (src_root / "sglang").is_dir():
        # before anything is written: patches/<pin>/ is replaced only by a series made from a real tree
        raise SystemExit(f"no pristine SGLang {pin} tree at {src_root} (expected {src_root / 'sglang'}/); "
                         f"set SGLANG_SRC to the folder that holds <pin>/sglang")
    work = Path(tempfile.mkdtemp(prefix=f"sglang-harden-gen-{pin}-"))
    cur = work / "cur"
    for rel in sorted({rel for _, _, edits in spec.PATCHES for rel, _, _ in edits}):
        if (src_root / rel).is_file():
            (cur / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src_root / rel, cur / rel)
    out = out_root / pin
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    series = []
    for idx, (name, header, edits) in enumerate(spec.PATCHES, start=1):
        prev = work / f"prev{idx}"
        touched = sorted({rel for rel, _, _ in edits})
        prev.mkdir()
        for rel in touched:
            if (cur / rel).exists():
                (prev / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(cur / rel, prev / rel)
        for rel, old, new in edits:
            apply_edit(cur, rel, old, new)
        body = "".join(diff_file(prev / rel, cur / rel, rel) for rel in touched)
        fname = f"{idx:04d}-{name}.patch"
        (out / fname).write_text(mail_header(header, idx, len(spec.PATCHES)) + body)
        series.append(fname)
    (out / "series").write_text(
        f"# sglang-harden backport series for SGLang {pin}; apply in order with patch -p1\n"
        f"# in the directory that contains sglang/ (or: sglang-harden patch apply --pin {pin} --tree DIR)\n"
        + "\n".join(series) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    print("wrote", out, series)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main(sys.argv[1])
