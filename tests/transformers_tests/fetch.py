"""Unpack the common test files of the installed transformers from its source distribution.

transformers does not ship its tests in the wheel. `make setup` runs this script with the project's interpreter: it
downloads the source distribution of exactly the installed version and unpacks its top-level `tests/*.py` files into
the virtual environment, where `transformers_tests` (this package) finds them. Nothing is copied into the repository,
so a new transformers release brings its own common tests (`make upgrade-check`).
"""

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import transformers


def unpacked_tests_dir() -> Path:
    """Where the installed transformers' common test files are unpacked: one folder per version, in the venv."""
    return Path(sys.prefix) / "transformers-tests" / transformers.__version__ / "tests"


def fetch() -> Path:
    target = unpacked_tests_dir()
    if (target / "test_modeling_common.py").is_file():
        return target
    version = transformers.__version__
    target.parent.mkdir(parents=True, exist_ok=True)
    # Unpacked beside the target, so that the final rename stays on one file system.
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
             "--dest", scratch, f"transformers=={version}"],
            check=True,
        )
        archive = next(Path(scratch).glob("transformers-*.tar.gz"))
        prefix = f"transformers-{version}/tests/"
        staging = Path(scratch) / "tests"
        staging.mkdir()
        with tarfile.open(archive) as sdist:
            for member in sdist.getmembers():
                relative = member.name.removeprefix(prefix)
                # The top-level common files only: tests/models is not in the distribution, and the mixins need nothing
                # below the top level that the distribution has.
                if member.isfile() and member.name.startswith(prefix) and "/" not in relative and relative.endswith(".py"):
                    (staging / relative).write_bytes(sdist.extractfile(member).read())
        if not (staging / "test_modeling_common.py").is_file():
            raise SystemExit(f"{archive.name} holds no {prefix}test_modeling_common.py")
        # The repository's tests/__init__.py (empty) is not in the distribution; test_configuration_common reads it.
        (staging / "__init__.py").write_text("")
        staging.rename(target)  # whole or not at all: a failed download leaves no half-filled folder
    return target


if __name__ == "__main__":
    print(f"transformers' common tests in {fetch()}")
