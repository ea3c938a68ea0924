"""Every test's processes keep Ray on loopback (patches/ray.py says why): set before any test imports Ray."""
import os

from patches.ray import ENV_SWITCH

os.environ.setdefault(ENV_SWITCH, "0")
