"""Drafters: the tree expansion every drafter shares (``base``), a small model of the target's family
(``small_model``), the target-aligned EAGLE-style drafter (``eagle``) and the DART-style parallel drafter (``dart``,
with its bigram, ``ngram``)."""
