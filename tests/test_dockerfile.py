"""The Dockerfile installs what `make test` installs: the same pinned pip tools, the lock file
with --no-deps, the Python version setup.cfg asks for, and Keras 2 for tensorflow-privacy.
No daemon or registry is reachable here, so the check is static."""
import configparser
import os
import re

from support import REPO_ROOT


def read(name):
    with open(os.path.join(REPO_ROOT, name)) as handle:
        return handle.read()


def instructions(text):
    """Dockerfile instructions with continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [line.strip() for line in joined.splitlines()
            if line.strip() and not line.strip().startswith("#")]


def test_dockerfile_installs_like_the_makefile():
    docker = instructions(read("Dockerfile"))
    makefile = read("Makefile")
    runs = " ".join(line for line in docker if line.startswith("RUN "))
    # The same pinned installer tools as the Makefile's venv.
    tools = re.search(r"pip install --quiet (pip==\S+ setuptools==\S+ wheel==\S+)", makefile)
    assert tools and tools.group(1) in runs
    # The lock file, without a resolver, before the package itself (also --no-deps).
    assert "COPY requirements/lock.txt requirements/lock.txt" in docker
    assert "pip install --quiet --no-deps -r requirements/lock.txt" in runs
    assert "--no-deps -r requirements/lock.txt" in makefile
    assert re.search(r"pip install --quiet --no-deps --no-build-isolation \.", runs)
    assert runs.index("requirements/lock.txt") < runs.index("--no-build-isolation .")
    env = " ".join(line for line in docker if line.startswith("ENV "))
    assert "TF_USE_LEGACY_KERAS=1" in env


def test_base_image_matches_the_supported_python_and_the_lock():
    # The last stage is the image; an earlier one only installs the chart library.
    base = [line.split()[1] for line in instructions(read("Dockerfile"))
            if line.startswith("FROM ")][-1]
    version = re.match(r"python:(\d+)\.(\d+)", base)
    assert version, base
    config = configparser.ConfigParser()
    config.read(os.path.join(REPO_ROOT, "setup.cfg"))
    assert config["options"]["python_requires"] == f">={version[1]}.{version[2]},<{version[1]}." \
                                                   f"{int(version[2]) + 1}"
    lock = read("requirements/lock.txt")
    # Every line of the lock is pinned (a --no-deps install of an unpinned line would drift).
    for line in lock.splitlines():
        if line.strip() and not line.startswith("#"):
            assert "==" in line or " @ " in line, line
    assert re.search(r"^tfx==1\.21\.", lock, re.M)


def test_the_build_context_leaves_out_local_environments():
    ignored = read(".dockerignore").split()
    assert ".venv" in ignored and "out" in ignored


def test_the_image_installs_the_chart_library_as_make_web_does():
    """The wheel holds the ledger page's chart library only if it is in the build context when
    `pip install .` runs (setup.cfg package data): the image installs it from the same lock."""
    docker = instructions(read("Dockerfile"))
    npm = re.search(r"cd sage_access/web && (npm ci [^\n]+)", read("Makefile"))
    assert npm and any(line == f"RUN {npm.group(1)}" for line in docker)
    assert "COPY sage_access/web/package.json sage_access/web/package-lock.json ./" in docker
    copied = [i for i, line in enumerate(docker)
              if line.startswith("COPY --from=") and "sage_access/web/node_modules" in line]
    installed = [i for i, line in enumerate(docker) if "--no-build-isolation ." in line]
    assert copied and installed and copied[0] < installed[0]
