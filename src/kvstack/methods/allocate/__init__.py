"""Budget allocation over layers and heads, composed with any scorer."""

from kvstack.methods.allocate import (  # noqa: F401
    adakv,
    cokv,  # noqa: F401
    d2o,  # noqa: F401
    headkv,  # noqa: F401
    prefix,  # noqa: F401
    pyramid,
    razor,  # noqa: F401
    squeeze,  # noqa: F401
)
