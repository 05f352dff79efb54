"""Built-in calibration prompts: varied on purpose (code, QA, math, chat, summarising, translating).

The Spec-Bench file is kept for evaluation; none of these prompts appears in it.
"""

CALIBRATION_PROMPTS: tuple[tuple[str, str], ...] = (
    ("code", "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring."),
    ("qa", "What causes the seasons on Earth? Answer in a short paragraph."),
    ("math", "A train travels 180 km in 2.5 hours. What is its average speed in km/h? Explain step by step."),
    ("chat", "I have a job interview tomorrow and I am nervous. Any advice?"),
    ("code", "Implement a stack class in Python with push, pop, peek and is_empty methods."),
    (
        "summary",
        "Summarize in two sentences: the printing press, invented by Gutenberg around 1440, made books "
        "cheaper, spread literacy across Europe and helped the ideas of the Reformation and the scientific "
        "revolution travel faster than ever before.",
    ),
    ("code", "Write a SQL query that lists the ten customers with the highest total order amount."),
    ("translate", "Translate into French: The library opens at nine in the morning and closes at six."),
    ("math", "Solve for x: 3x + 7 = 22. Show your work."),
    ("code", "Write a bash command that counts the lines of all .py files in a directory tree."),
    ("qa", "Who wrote 'Pride and Prejudice', and what is the novel about?"),
    ("code", "Explain the difference between a list and a tuple in Python, with a short example."),
)
# Held out from calibration: used only to check that the searched mask generalises.
HELD_OUT_PROMPTS: tuple[tuple[str, str], ...] = (
    ("code", "Write a Python function that checks whether a number is prime."),
    ("qa", "Why is the sky blue? Keep it brief."),
    ("code", "Write a C function that reverses a string in place."),
    ("math", "What is 15% of 240? Show the calculation."),
    ("chat", "Suggest three names for a small coffee shop and say why."),
)
