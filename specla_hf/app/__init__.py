"""The ``specla`` command line, the Gradio demo and model loading: users of the library, not part of it.

``import specla_hf`` never imports this package.
"""
