"""Developer scripts that live next to headwater (benchmarks); not part of the installed package."""
