"""Optional backends that run parts of the layer on other libraries' kernels.

``deepgemm``: upstream DeepGEMM's published grouped GEMMs (SM90) and Mega MoE forward (SM100).
Importing this package never imports the libraries themselves; each backend reports
``is_available()`` and raises a RuntimeError that says how to install what it needs.
"""
