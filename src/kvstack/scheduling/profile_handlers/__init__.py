"""Profile handlers: which scheduling profiles run for a request, and how their results combine."""
