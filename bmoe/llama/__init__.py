"""The llama.cpp seam: everything bmoe asks of llama.cpp, on a floor of its own.

``seam`` (model, context, tokens, logits, decode), ``loader`` and ``open_reserved`` (the opens:
mapped, user-filled, reserved), ``isolate`` (a file's first open in a child process), ``callback``
(the eval and abort callbacks, capture warm-ups) with ``node_filter`` (the C first-bytes filter in
front of it), ``expert_major`` (a prompt's experts computed group by group), ``drop_cold`` and
``route_ahead`` (the lossy levers' node work) and ``blas`` (one BLAS thread beside llama.cpp's).

It sits beside ``bmoe.stages`` and never imports it: the compute side and the I/O pipeline meet only
at ``bmoe.pipeline.gate`` (routing in, readiness out) and ``bmoe.pipeline.boundary`` (the modes
value). ``bmoe.engine`` composes the two.
"""
