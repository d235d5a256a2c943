"""Package discovery: every package under shardkit/ and backends/ (installed as shardkit_backends).

Metadata, dependencies and entry points live in setup.cfg. Packages are found, never listed by
hand, so a new subpackage cannot be left out of the wheel; `.ci/wheel-smoke` tests the wheel.
"""

from setuptools import find_packages, setup

BACKENDS_DIR, BACKENDS_PACKAGE = "backends", "shardkit_backends"

packages = find_packages(include=["shardkit", "shardkit.*"])
packages += [BACKENDS_PACKAGE + name[len(BACKENDS_DIR):]
             for name in find_packages(include=[BACKENDS_DIR, BACKENDS_DIR + ".*"])]

setup(packages=packages, package_dir={BACKENDS_PACKAGE: BACKENDS_DIR})
