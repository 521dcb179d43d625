"""Testbed: real SGLang PD pairs on CPU for each supported pin (see DESIGN.md)."""
