"""Planning ahead: the cost model, plans, their search by simulation, and the planner that holds them."""
