"""GOAT (Fang et al., ToN 2024): gradient scheduling with collaborative
in-network aggregation. The planner (LP relaxation of GINA + KRGS), the
asynchronous extension (Algorithm 2, K_t and K_t^s), the baselines
(Geryon, ATP, ESA, K-SGD) and one flow-level evaluator for all of them.
See docs/goat.md."""
