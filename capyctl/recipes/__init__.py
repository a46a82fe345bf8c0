"""Recipes: deployment files measured through CapyCTL into published, reproducible reports.

``_recipe`` reads and checks a recipe; ``_runner`` runs one (a client of CapyCTL, driving the
``capyctl`` command and measuring with capyctl bench); ``_render`` writes its report;
``_points`` turns a report into rows of the results table; ``_compare`` puts reports side by
side; ``_cli`` is ``capyctl recipe``.
"""

from ._recipe import Recipe, RecipeError, load_recipe, parse_recipe

__all__ = ["Recipe", "RecipeError", "load_recipe", "parse_recipe"]
