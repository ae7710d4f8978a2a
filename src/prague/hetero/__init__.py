"""Heterogeneity injection shared by the runtime and the simulator."""

from prague.hetero.spec import InjectedCrash, Scenario, parse_scenario, uniform

__all__ = ["InjectedCrash", "Scenario", "parse_scenario", "uniform"]
