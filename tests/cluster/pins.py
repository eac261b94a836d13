"""Run on the launched head (`ray exec ... 'python ~/src/raytrain_events/tests/cluster/pins.py'`): the packages
cluster.yaml's setup commands install satisfy each other's requirements (as `pip check` would say for them),
e.g. botocore within aiobotocore's pin after boto3 is installed. Exit 1 naming each conflict."""

import sys
from importlib.metadata import PackageNotFoundError, distribution, version

from packaging.requirements import Requirement

ROOTS = ["raytrain_events", "ray", "boto3", "botocore", "aiobotocore", "s3fs", "fsspec", "torch", "scikit-learn"]


def conflicts():
    for name in ROOTS:
        for text in distribution(name).requires or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": "s3"}):
                continue
            try:
                installed = version(req.name)
            except PackageNotFoundError:
                continue  # an extra we did not ask for
            if not req.specifier.contains(installed, prereleases=True):
                yield f"{name} requires {req}, but {req.name} {installed} is installed"


found = list(conflicts())
print("\n".join(found) if found else f"pins agree: {', '.join(f'{n} {version(n)}' for n in ROOTS)}")
sys.exit(1 if found else 0)
