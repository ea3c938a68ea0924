"""The command-line tools. Importing the package installs the cache of transformers' import structure, as importing
slime.utils does (slime/utils/import_structure_cache.py): a tool that writes a checkpoint imports transformers before
anything else of slime would."""
import slime.utils  # noqa: F401
