"""The configuration of a run: every flag of ``train.py`` (``flags``), what upstream flags do here
(``registries``), the pre-Ray checks (``checks``, run in order by ``validate``), ``--help`` (``help``),
``parse_args`` (``parse``), the launch checks (``launch``) and the parallel layout (``layout``).

``slime.utils.arguments`` re-exports the names upstream slime and its plug-ins import.
"""
