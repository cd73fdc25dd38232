"""The installed package: one import name, k4, with the CUDA sources and the sample model as
package data. Builds the wheel from a copy of the sources, lists it, installs it into a fresh
virtual environment and runs `k4 run` from another directory."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "cli", "runtime", "kernels_cu", "samples")


def copy_sources(dst: Path) -> Path:
    """The files a build reads, copied to dst (no build/ or egg-info of the checkout leaks in)."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, dst / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, dst / name)
    return dst


def fresh_venv(path: Path) -> Path:
    """A venv whose own site-packages come first; the system's supply the dependencies (no
    network needed). Returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(path)], check=True)
    return path / "bin" / "python"


def run_k4_elsewhere(venv: Path, tmp_path: Path) -> Path:
    """`k4 run -n 8` of the sample model from a directory outside the sources, through venv's
    console script, and nothing importable as top-level cli or runtime. Returns where k4.cli
    was imported from."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = subprocess.run([str(venv / "bin" / "k4"), "run", "-n", "8", "--backend", "numpy", "Once upon a time"],
                       cwd=elsewhere, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Once upon a time") and len(r.stdout) > len("Once upon a time ")
    probe = ("import importlib.util as u, k4.cli, k4.runtime; "
             "print(u.find_spec('cli') is None, u.find_spec('runtime') is None, k4.cli.__file__)")
    r = subprocess.run([str(venv / "bin" / "python"), "-c", probe], cwd=elsewhere, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    no_cli, no_runtime, where = r.stdout.split()
    assert no_cli == "True" and no_runtime == "True"
    return Path(where)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = copy_sources(tmp_path_factory.mktemp("src"))
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(out), str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    (whl,) = out.glob("k4-*.whl")
    return whl


def test_wheel_holds_only_the_k4_package_with_its_data(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"k4", wheel.name.split("-py")[0] + ".dist-info"}, tops
    for required in ("k4/cli/app.py", "k4/runtime/model.py", "k4/runtime/cuda/backend.py",
                     "k4/kernels_cu/common.cuh", "k4/kernels_cu/gemv.cu", "k4/samples/stories260k-q4_k_m.gguf"):
        assert required in names
    assert not any("__pycache__" in n or n.startswith("k4/tests") for n in names)
    sources = {p.name for p in (REPO / "kernels_cu").iterdir() if p.suffix in (".cu", ".cuh")}
    assert sources == {Path(n).name for n in names if n.startswith("k4/kernels_cu/") and n[-3:] in (".cu", "cuh")}


def test_installed_wheel_runs_from_another_directory(wheel, tmp_path):
    venv = tmp_path / "venv"
    python = fresh_venv(venv)
    r = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert run_k4_elsewhere(venv, tmp_path).is_relative_to(venv)


def test_editable_install_runs_from_another_directory(tmp_path):
    src = copy_sources(tmp_path / "src")
    venv = tmp_path / "venv"
    python = fresh_venv(venv)
    r = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-q", "-e", str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert run_k4_elsewhere(venv, tmp_path).is_relative_to(src)  # the sources themselves, not a copy
