"""The package installs whole (issue 30): the wheel built from the repository holds every
package, the taxi example's files and the ledger page's assets, and works from a fresh
environment whose current directory is not the clone.

How the fresh environment is made, and why it is faithful: `python -m venv --without-pip`, then
one `.pth` line naming the project environment's site-packages, which `make` installed from
requirements/lock.txt with --no-deps (the test checks every pin of the lock is what that
directory holds). A plain path line in a .pth file puts the directory on sys.path without
running the .pth files inside it, so the project's editable install (a finder that a .pth there
installs) is invisible: `sage_tfx` can only come from the wheel. Installing the lock again into
a new venv would take 5-7 minutes and 3.4 GB (shared STACK.md) to get the same files. The wheel
itself is installed by pip running inside the new environment (--ignore-installed, so pip
neither consults nor touches the project's own sage-tfx record), with its console script.
"""
import configparser
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
import urllib.request
import zipfile

import pytest

from support import REPO_ROOT

# What a build must not copy from the clone: environments, outputs, caches.
_NOT_SOURCE_NAMES = (".git", ".venv", ".lockenv", "out", "build", "*.egg-info", "__pycache__",
                     ".pytest_cache", ".hypothesis")
_NOT_SOURCE = shutil.ignore_patterns(*_NOT_SOURCE_NAMES)
# What a fresh clone lacks until `make web`: the ledger page's chart library (setup.py).
_CHART_LIBRARY = [f"sage_access/web/node_modules/plotly.js-basic-dist-min/{name}"
                  for name in ("package.json", "plotly-basic.min.js", "LICENSE")]
PLOTLY = "sage_tfx/sage_access/web/node_modules/plotly.js-basic-dist-min/plotly-basic.min.js"


def _source_packages() -> set[str]:
    """Every folder of the clone with an __init__.py, as its sage_tfx.* name (tests/ is not
    installed; its helpers are support.*)."""
    found = set()
    for directory, folders, files in os.walk(REPO_ROOT):
        folders[:] = [f for f in folders if not f.startswith(".") and f not in
                      ("tests", "node_modules", "build", "out", "__pycache__")]
        if "__init__.py" in files:
            relative = os.path.relpath(directory, REPO_ROOT)
            found.add("sage_tfx" if relative == "." else
                      "sage_tfx." + relative.replace(os.sep, "."))
    return found


def test_setup_cfg_lists_every_package():
    """A package left out of setup.cfg is missing from the wheel (issue 30: dp_aggregate was),
    and only an installed environment notices."""
    config = configparser.ConfigParser()
    config.read(os.path.join(REPO_ROOT, "setup.cfg"))
    listed = set(config["options"]["packages"].split())
    assert _source_packages() == listed


def _lock_pins() -> dict[str, str]:
    pins = {}
    with open(os.path.join(REPO_ROOT, "requirements", "lock.txt")) as handle:
        for line in handle:
            match = re.match(r"^([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==([^\s;#]+)", line)
            if match:
                pins[match[1]] = match[2]
    return pins


def _fresh_clone(tmp_path):
    """A copy of the clone's sources as `git clone` gives them: without node_modules."""
    source = tmp_path / "source"
    shutil.copytree(REPO_ROOT, source, ignore=shutil.ignore_patterns(*_NOT_SOURCE_NAMES,
                                                                     "node_modules"))
    return source


def _build(source, kind: str, out):
    """setuptools' PEP 517 build of a wheel or an sdist of `source` into `out` (what pip and
    `python -m build` call, without an isolated environment)."""
    return subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                           f"build_meta.build_{kind}(sys.argv[1])", str(out)], cwd=source,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("kind", ["wheel", "sdist"])
def test_a_build_from_a_fresh_clone_stops_and_says_how_to_get_the_chart_library(tmp_path, kind):
    """Without `make web` the wheel was built without the ledger page's chart library (setup.cfg
    takes it from node_modules, which a clone lacks), and `ledger serve` then would not start."""
    source = _fresh_clone(tmp_path)
    built = _build(source, kind, tmp_path / "dist")
    assert built.returncode != 0
    assert "chart library is missing" in built.stderr and "make web" in built.stderr
    assert not list((tmp_path / "dist").glob("sage_tfx-*"))


def test_an_sdist_holds_the_chart_library_and_builds_a_wheel_that_does(tmp_path):
    """With the library in place (files standing in for what `make web` installs), the sdist
    carries it, so a wheel built from the sdist alone holds it too."""
    source = _fresh_clone(tmp_path)
    for path in _CHART_LIBRARY:
        (source / path).parent.mkdir(parents=True, exist_ok=True)
        (source / path).write_text("{}\n" if path.endswith(".json") else "// stand-in\n")
    built = _build(source, "sdist", tmp_path / "dist")
    assert built.returncode == 0, built.stderr[-3000:]
    [archive] = (tmp_path / "dist").glob("sage_tfx-*.tar.gz")
    unpacked = tmp_path / "unpacked"
    shutil.unpack_archive(archive, unpacked)
    [from_sdist] = unpacked.iterdir()
    assert all((from_sdist / path).is_file() for path in _CHART_LIBRARY)
    built = _build(from_sdist, "wheel", tmp_path / "wheel")
    assert built.returncode == 0, built.stderr[-3000:]
    [wheel] = (tmp_path / "wheel").glob("sage_tfx-*.whl")
    with zipfile.ZipFile(wheel) as contents:
        names = set(contents.namelist())
    assert all(f"sage_tfx/{path}" in names for path in _CHART_LIBRARY)
    assert "sage_tfx/setup.py" not in names


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(environment directory, a scratch directory outside the clone) with the wheel installed."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"
    shutil.copytree(REPO_ROOT, source, ignore=_NOT_SOURCE)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                            "--no-build-isolation", "--quiet", "-w", str(tmp / "dist"),
                            str(source)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    [wheel] = (tmp / "dist").glob("sage_tfx-*.whl")
    env = tmp / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    python = str(env / "bin" / "python")
    env_site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()"
                               "['purelib'])"], capture_output=True, text=True,
                              check=True).stdout.strip()
    with open(os.path.join(env_site, "lock-dependencies.pth"), "w") as handle:
        handle.write(sysconfig.get_paths()["purelib"] + "\n")
    done = subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                           "--ignore-installed", str(wheel)],
                          capture_output=True, text=True, timeout=600, cwd=tmp)
    assert done.returncode == 0, done.stderr[-3000:]
    return env, wheel, tmp


def _run(env, *command, cwd, timeout=300):
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    environment["PATH"] = f"{env / 'bin'}{os.pathsep}{environment.get('PATH', '')}"
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env=environment)


@pytest.mark.slow
def test_the_wheel_holds_every_package_and_the_assets(installed):
    _, wheel, _ = installed
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    for package in _source_packages():
        assert package.replace(".", "/") + "/__init__.py" in names, package
    for asset in (PLOTLY, "sage_tfx/sage_access/web/static/index.html",
                  "sage_tfx/examples/taxi/taxi_module.py",
                  "sage_tfx/examples/tfx_taxi/taxi_utils_native_keras.diff",
                  "sage_tfx/examples/taxi/workloads/hour_area_payment.json",
                  "sage_tfx/examples/taxi/workloads/trip_durations.json",
                  "sage_tfx/components/dp_trainer/step_kernels.cc"):
        assert asset in names, asset
    assert not any(name.startswith("sage_tfx/tests/") for name in names)


@pytest.mark.slow
def test_the_installed_wheel_imports_and_runs_outside_the_clone(installed):
    env, _, tmp = installed
    scratch = tmp / "elsewhere"
    scratch.mkdir(exist_ok=True)
    python = str(env / "bin" / "python")
    # The dependencies are the lock's exact set.
    lock = json.dumps(_lock_pins())
    check = _run(env, python, "-c", f"""
import importlib.metadata as m, json
wrong = {{n: (v, m.version(n)) for n, v in json.loads({lock!r}).items() if m.version(n) != v}}
assert not wrong, wrong
""", cwd=scratch)
    assert check.returncode == 0, check.stderr[-3000:]
    # Every public name of sage_tfx.components, from the wheel (not the clone).
    imported = _run(env, python, "-c", """
import os, sys, sage_tfx, sage_tfx.components as c
here = os.path.realpath(sage_tfx.__file__)
assert here.startswith(os.path.realpath(sys.prefix)), here
for name in c.__all__:
    getattr(c, name)
from sage_tfx.examples.taxi import taxi_module, stream
from sage_tfx.components.dp_trainer import step_ops  # DP-SGD's kernels compile from the wheel
print(len(c.__all__), os.path.isfile(stream.__file__), hasattr(step_ops.library(), "add_noise"))
""", cwd=scratch)
    assert imported.returncode == 0, imported.stderr[-3000:]
    assert imported.stdout.split() == ["18", "True", "True"]
    helped = _run(env, str(env / "bin" / "sage-tfx"), "--help", cwd=scratch)
    assert helped.returncode == 0 and "sage-tfx ledger" in helped.stdout, helped.stderr
    store = str(scratch / "ledger.sqlite")
    created = _run(env, str(env / "bin" / "sage-tfx"), "ledger", "--store", store, "init",
                   cwd=scratch)
    assert created.returncode == 0, created.stderr


@pytest.mark.slow
def test_ledger_serve_from_the_wheel_serves_the_page_and_its_chart_library(installed):
    env, _, tmp = installed
    scratch = tmp / "serve"
    scratch.mkdir()
    store = str(scratch / "ledger.sqlite")
    sage = str(env / "bin" / "sage-tfx")
    assert _run(env, sage, "ledger", "--store", store, "init", cwd=scratch).returncode == 0
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    server = subprocess.Popen([sage, "ledger", "--store", store, "serve", "--port", "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=scratch, env=environment)
    try:
        address = None
        deadline = time.monotonic() + 120
        while address is None and time.monotonic() < deadline:
            line = server.stdout.readline()
            assert line, server.stderr.read()[-3000:]
            found = re.search(r"at (http://127\.0\.0\.1:\d+/)", line)
            address = found and found[1]
        page = urllib.request.urlopen(address, timeout=30).read().decode()
        assert '<script src="/static/ledger.js"' in page
        # The page's script asks the API where the chart library is.
        contexts = json.load(urllib.request.urlopen(address + "api/contexts", timeout=30))
        library = urllib.request.urlopen(address.rstrip("/") + contexts["plotly"],
                                         timeout=30).read()
        with open(os.path.join(REPO_ROOT, PLOTLY.replace("sage_tfx/", "", 1)), "rb") as handle:
            assert library == handle.read()
    finally:
        server.terminate()
        server.wait(timeout=30)
