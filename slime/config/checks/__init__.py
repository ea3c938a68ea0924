"""The pre-Ray checks of the parsed flags, one module per concern; ``slime.config.validate`` runs them in order.

Each check is a short function that fills derived values or raises ``ArgumentValidationError`` naming the flags
and the fix."""
