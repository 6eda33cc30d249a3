"""bench/run_gpu.sh's JSON files: one per part of a device run (the device tool brings back 8
files at most).

    python bench/gpu_parts.py merge DIR OUT.json     # every DIR/NAME.json as {NAME: its content}
    python bench/gpu_parts.py junit JUNIT.xml OUT.json   # pytest's outcome counts and failures
    python bench/gpu_parts.py sources [ROOT]         # the digest of what a build of lowfp reads
"""

import hashlib
import json
import pathlib
import sys
import xml.etree.ElementTree as ET


def merge(folder: str) -> dict:
    """The JSON files of a folder as one object, keyed by file name without .json."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(pathlib.Path(folder).glob("*.json"))}


def junit(path: str) -> dict:
    """pytest's JUnit XML report as {"outcome": counts of passed, failed, error and skipped,
    "failures": [{"test", "message"}] with each failure's or error's first line}."""
    outcome = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    failures = []
    for case in ET.parse(path).getroot().iter("testcase"):
        bad = next((e for e in case if e.tag in ("failure", "error")), None)
        if bad is not None:
            outcome["failed" if bad.tag == "failure" else "error"] += 1
            failures.append({"test": f"{case.get('classname')}::{case.get('name')}",
                             "message": (bad.get("message") or "").split("\n", 1)[0]})
        elif case.find("skipped") is not None:
            outcome["skipped"] += 1
        else:
            outcome["passed"] += 1
    return {"outcome": outcome, "failures": failures}


# What a build of lowfp reads: a prebuilt wheel (bench/prebuild_gpu.sh) stands for a build of the
# working tree where the digests of these are equal. Caches and build outputs are not read.
BUILD_INPUTS = ("CMakeLists.txt", "pyproject.toml", "cpp", "python")
_NOT_READ = {".pyc", ".so", ".o"}


def sources(root: str = ".") -> str:
    """The SHA-256 of the build's input files (BUILD_INPUTS, in sorted order), each one's path
    relative to ``root`` and its bytes."""
    base = pathlib.Path(root)
    files = []
    for name in BUILD_INPUTS:
        top = base / name
        found = [top] if top.is_file() else top.rglob("*")
        files += [p for p in found if p.is_file() and p.suffix not in _NOT_READ and "__pycache__" not in p.parts]
    digest = hashlib.sha256()
    for path in sorted(files, key=lambda p: p.relative_to(base).as_posix()):
        data = path.read_bytes()
        digest.update(f"{path.relative_to(base).as_posix()}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["sources"] and len(argv) <= 2:
        print(sources(*argv[1:]))
        return 0
    if len(argv) != 3 or argv[0] not in ("merge", "junit"):
        print(__doc__, file=sys.stderr)
        return 2
    what, src, dst = argv
    with open(dst, "w") as f:
        json.dump(merge(src) if what == "merge" else junit(src), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
