"""Build the fork: the pinned upstream ``pytorch-lightning`` wheel plus ``patches/series``.

``pip install .``, ``pip install -e .`` and ``pip install git+<repo>@<branch>`` all run this file, which first
materialises ``pytorch_lightning/`` (git-ignored) and then packages it as distribution ``pytorch-lightning`` with
a local version such as ``1.6.5.post0+fsdp.7``.
"""
import os
import sys

from setuptools import find_packages, setup

# setuptools' PEP 517 backend does not put the project root on sys.path.
_ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _ROOT)

from fork_tools.materialize import local_edits, materialize  # noqa: E402
from fork_tools.upstream import BuildError  # noqa: E402


def _requirements(name):
    with open(os.path.join(_ROOT, "requirements", name)) as f:
        return [ln.split("#", 1)[0].strip() for ln in f if ln.split("#", 1)[0].strip()]


try:
    _VERSION = materialize()
except BuildError as err:
    sys.exit(f"error: building the pytorch_lightning fork failed:\n{err}")
for _path in local_edits():
    print(f"warning: {_path} differs from upstream + patches/ (refresh it into a patch)", file=sys.stderr)

setup(
    name="pytorch-lightning",
    version=_VERSION,
    description="PyTorch Lightning 1.6.5 with FairScale FSDP checkpoint-memory fixes (patch-series fork)",
    long_description=open(os.path.join(_ROOT, "README.md")).read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=find_packages(include=["pytorch_lightning", "pytorch_lightning.*"]),
    package_data={"pytorch_lightning": ["py.typed"]},
    # fork_tools (run by this build) uses sys.stdlib_module_names, new in 3.10; torch 2.13 needs 3.10 as well.
    python_requires=">=3.10",
    install_requires=_requirements("base.txt"),
    extras_require={
        "test": _requirements("test.txt"),
        # Checkpoints in S3-compatible object storage: s3fs (fsspec's "s3://"), its botocore reading AWS_ENDPOINT_URL.
        "s3": ["s3fs>=2023.9.0"],
        # The converter's `--to safetensors`: safetensors' writer from pointers (TensorSpec), huggingface_hub's shards.
        "hub": ["safetensors>=0.8", "huggingface_hub>=0.26"],
    },
    zip_safe=False,
)
