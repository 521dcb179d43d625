"""sglang-harden: guards for SGLang prefill/decode disaggregation.

Kept import-light on purpose: a ``.pth`` start-up hook imports this package in every Python process of an
environment where it is installed, so nothing here may import SGLang, torch or heavy modules.
"""

__version__ = "0.1.0"
