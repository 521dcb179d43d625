# 0.5.23: the 0.5.22 series as it is (every anchor holds on 0.5.23's source).
from spec_0_5_22 import PATCHES  # noqa: F401
