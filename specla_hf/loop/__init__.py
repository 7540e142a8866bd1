"""The decoding loop: one step (propose, verify, accept, commit, emit) driven on the host or on the device
(``decode``), its acceptance rules (``acceptance``), stopping (``stopping``) and statistics (``stats``)."""
