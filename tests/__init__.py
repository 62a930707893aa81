"""kvtier's test suite (a package, so its helpers import as tests.* in every environment)."""
