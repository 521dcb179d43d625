"""Wire formats that prefill and decode exchange outside SGLang's own messages, shared by the plugin and the
backport series (each module's code below its embed mark is copied verbatim into the patched tree by
``patches/_source/gen.py``; a unit test regenerates the series and fails on drift). Standard library only."""
