"""Helpers every room uses. Importing the package installs the cache of transformers' import structure
(import_structure_cache.py): every process of a run imports slime.utils before it imports transformers."""
from slime.utils.import_structure_cache import cache_transformers_import_structure

cache_transformers_import_structure()
