# 0.4.10.post2: the 0.4.9.post6 series as it is (every anchor holds on 0.4.10.post2's source).
from spec_0_4_9_post6 import PATCHES  # noqa: F401
