"""The pure decision: what a delivery meets (facts) and what it does about it (decide)."""
