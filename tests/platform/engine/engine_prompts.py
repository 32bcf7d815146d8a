"""Prompts of different lengths and kinds shared by the engine tests."""

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea:",
    "def quicksort(xs):",
    "Q: What is 17 * 3?\nA:",
    "Once upon a time, in a village at the edge of a great forest, there lived an old "
    "clockmaker who had never once been late. One morning",
    "List three primary colors:",
    "Translate to French: 'Good morning, how are you today?'",
    "The quick brown fox",
]
