"""Group filters for dynamic sampling (`--dynamic-sampling-filter-path`), at upstream's module path."""
