"""The ``torchpass-p2p`` command line: ``launch``, ``drain`` and ``status`` (:mod:`.main`)."""
