"""Training drafters (``specla-train-drafter``) and building test-shaped models (function-preserving inflation).

``import specla_hf`` never imports this package.
"""
