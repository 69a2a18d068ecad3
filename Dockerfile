# The image every step of a compiled sage-tfx pipeline runs in (`sage-tfx compile --image ...`).
#   docker build -t REGISTRY/sage-tfx:0.1.0 . && docker push REGISTRY/sage-tfx:0.1.0
# (docs/pipelines.md: build, push, compile, upload, point the ledger at the cluster's metadata.)

# The ledger page's chart library, as `make web` installs it (npm ci from the pinned
# sage_access/web/package-lock.json), so that the wheel below holds it (setup.cfg package data).
FROM node:20-bookworm-slim AS web
WORKDIR /web
COPY sage_access/web/package.json sage_access/web/package-lock.json ./
RUN npm ci --ignore-scripts --no-audit --no-fund --loglevel=error

# Debian 12 with CPython 3.11, the platform the lock file was verified on (shared STACK.md): TFX
# 1.21's own image pins packages the lock replaces (ml-metadata 1.21 needs glibc 2.39).
FROM python:3.11.7-slim-bookworm

# tensorflow-privacy's DP optimizers need Keras 2 (tf_keras), chosen when TensorFlow is imported.
ENV TF_USE_LEGACY_KERAS=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /opt/sage-tfx
# As the Makefile does: every package pinned in the lock, installed without a resolver.
COPY requirements/lock.txt requirements/lock.txt
RUN pip install --quiet pip==24.3.1 setuptools==75.8.0 wheel==0.45.1 \
    && pip install --quiet --no-deps -r requirements/lock.txt
COPY . .
COPY --from=web /web/node_modules sage_access/web/node_modules
# Installed as a wheel (not editable), as tests/test_wheel.py installs it. Importing the numba
# kernels compiles them into the image (sage_tfx.compiled: a pod then loads them at import), and
# DP-SGD's step kernels are compiled there too, for CPUs with and without AVX2 (step_ops, with
# g++, removed after it).
RUN pip install --quiet --no-deps --no-build-isolation . \
    && apt-get update -qq && apt-get install -y -qq --no-install-recommends g++ > /dev/null \
    && cd / && python -c "import sage_tfx.components as c; [getattr(c, n) for n in c.__all__]; \
from sage_tfx.sage_access.web.app import chart_library; chart_library(); \
import sage_tfx.mechanisms.keyed, sage_tfx.dp_statistics.continual.blt_kernel, \
    sage_tfx.components.dp_trainer.noise_kernel; \
from sage_tfx.components.dp_trainer import step_ops; \
step_ops.compiled_library(); step_ops.compiled_library(vector_flags=[])" \
    && apt-get purge -y -qq g++ > /dev/null && apt-get autoremove -y -qq > /dev/null \
    && rm -rf /var/lib/apt/lists/* \
    && sage-tfx --help > /dev/null
