# 0.5.22: the 0.5.21 series as it is (every anchor holds on 0.5.22's source).
from spec_0_5_21 import PATCHES  # noqa: F401
