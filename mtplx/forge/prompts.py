"""The prompt set forge generates its training data from, and the held-out prompts it measures on.

Training prompts are built from templates crossed with topics (chat questions, code, prose,
lists, advice, comparisons, rewrites, emails, small maths), so a few hundred lines give a few
thousand varied requests. The held-out prompts are written separately, in other words and on
other subjects; ``tests/test_forge.py`` checks that none of them is a training prompt.
"""

from __future__ import annotations

import random

PROMPT_SET_VERSION = "forge-prompts-v1"

_CONCEPTS = (
    "photosynthesis", "gravity", "inflation", "the water cycle", "machine learning", "compound interest",
    "the immune system", "plate tectonics", "supply and demand", "black holes", "DNA", "democracy",
    "climate change", "electricity", "the internet", "vaccines", "recursion", "encryption", "evolution",
    "the stock market", "nuclear energy", "the French Revolution", "blockchain", "the placebo effect",
    "cloud computing", "the greenhouse effect", "probability", "magnetism", "the Roman Empire", "sleep",
    "the human heart", "volcanoes", "solar panels", "antibiotics", "neural networks", "opportunity cost",
    "the speed of light", "tides", "the printing press", "time zones", "an operating system", "a database",
    "version control", "the theory of relativity", "rainbows", "earthquakes", "the scientific method",
    "photosynthesis in algae", "habits", "memory", "taxes", "interest rates", "batteries", "wind turbines",
    "the moon's phases", "bacteria", "a compiler", "a web browser", "the Pythagorean theorem", "fractions",
    "the Industrial Revolution", "coral reefs", "the food chain", "ocean currents", "a credit score",
)
_EXPLAIN = (
    "Explain {} in simple terms.",
    "What is {}? Give a short explanation.",
    "Can you explain {} to a ten-year-old?",
    "Give me a brief overview of {}.",
    "Why is {} important?",
    "Describe how {} works.",
    "Write a short paragraph about {}.",
    "What are the key facts about {}?",
    "Explain {} in three sentences.",
    "What is a common misconception about {}?",
)
_HOW_TO = (
    "learn a new language quickly", "bake bread at home", "start running", "save money each month",
    "write a good resume", "prepare for a job interview", "grow tomatoes", "make a budget", "meditate",
    "improve my handwriting", "study for an exam", "fall asleep faster", "change a flat tire",
    "make cold brew coffee", "organize my closet", "give a good presentation", "learn to play the guitar",
    "write a cover letter", "train a puppy", "reduce stress", "make friends in a new city", "cook rice",
    "start a vegetable garden", "clean a laptop keyboard", "take better photos with my phone",
    "set up a home network", "make a paper airplane", "plan a road trip", "read more books",
    "back up my computer", "negotiate a salary", "write a haiku", "brew tea properly", "stay focused",
    "make pancakes", "keep houseplants alive", "improve my posture", "learn to swim", "wake up early",
)
_HOW_TO_FORMS = ("How do I {}?", "What is the best way to {}?", "Give me step-by-step instructions to {}.",
                 "I want to {}. Where should I start?")
_CODE_TASKS = (
    "reverses a string", "checks whether a number is prime", "returns the factorial of n",
    "computes the nth Fibonacci number", "counts the vowels in a string", "removes duplicates from a list",
    "finds the largest element in a list", "sorts a list of dictionaries by a key", "merges two sorted lists",
    "checks whether a string is a palindrome", "converts Celsius to Fahrenheit", "flattens a nested list",
    "counts word frequencies in a text", "returns the sum of the digits of a number",
    "validates an email address", "reads a CSV file and prints each row", "finds the second largest number",
    "computes the greatest common divisor of two numbers", "checks whether two strings are anagrams",
    "implements binary search", "transposes a matrix", "generates all permutations of a list",
    "capitalizes the first letter of every word", "computes the average of a list of numbers",
    "returns the prime factors of a number", "chunks a list into pieces of size n",
    "converts a binary string to an integer", "finds the longest word in a sentence",
    "checks whether a year is a leap year", "rotates a list by k positions",
)
_LANGUAGES = ("Python", "Python", "Python", "JavaScript", "Java", "C", "Rust", "Go")
_CODE_FORMS = ("Write a {lang} function that {task}.", "Show me {lang} code that {task}.",
               "How would you write a {lang} program that {task}?")
_CODE_QUESTIONS = (
    "What does the Python keyword 'yield' do?", "Explain the difference between a list and a set in Python.",
    "What is a REST API?", "What is the difference between git merge and git rebase?",
    "Explain what a SQL JOIN does with an example.", "What is object-oriented programming?",
    "How does a hash table work?", "What is Big O notation?", "Explain what a closure is in JavaScript.",
    "What is the difference between a process and a thread?", "Write a SQL query that selects all users older than 30.",
    "Write a bash command that counts the lines in every .txt file in a folder.",
    "What is a unit test and why is it useful?", "Explain how a for loop works in Python with an example.",
    "What is the difference between == and 'is' in Python?", "How do I read a file line by line in Python?",
    "Write a regular expression that matches a US phone number.", "What is a linked list?",
    "Explain the purpose of a virtual environment in Python.", "What is JSON and how is it used?",
    "Fix this Python code: for i in range(10) print(i)", "What does 'git commit --amend' do?",
    "Write a Python class for a bank account with deposit and withdraw methods.",
    "Write an HTML page with a heading and a button.", "Write a CSS rule that centers a div.",
)
_SUBJECTS = (
    "a lighthouse keeper", "a lost cat", "the first day of spring", "a robot learning to paint",
    "an old oak tree", "a city at night", "a dragon who is afraid of fire", "the ocean", "a rainy afternoon",
    "a time traveler", "friendship", "a small bakery", "the mountains", "a child's first snow",
    "an astronaut far from home", "a forgotten library", "autumn leaves", "a detective in Paris",
    "a garden at dawn", "a musician on the street", "the last bus home", "a talking parrot", "the desert",
    "a village by the sea", "an inventor's workshop", "a storm at sea", "a family dinner", "the stars",
    "a new job", "a long train journey", "a haunted house", "a river", "an unexpected letter",
)
_PROSE_FORMS = (
    "Write a short story about {}.", "Write a poem about {}.", "Write a haiku about {}.",
    "Describe {} in a vivid paragraph.", "Write the opening paragraph of a novel about {}.",
    "Write a limerick about {}.", "Write a four-line poem about {}.",
)
_LIST_THINGS = (
    "fruits that are high in vitamin C", "countries in South America", "ways to save energy at home",
    "classic novels everyone should read", "healthy breakfast ideas", "programming languages",
    "famous scientists", "board games for families", "benefits of regular exercise",
    "things to pack for a camping trip", "tips for better sleep", "inventions of the 20th century",
    "indoor hobbies", "common job interview questions", "ways to reduce plastic waste",
    "animals that live in the Arctic", "skills every student should learn", "uses of baking soda",
    "reasons to learn a second language", "famous landmarks in Europe", "vegetables that are easy to grow",
    "ideas for a birthday party", "productivity apps", "ways to be more creative", "planets in the solar system",
    "types of clouds", "questions to ask on a first date", "dog breeds for apartments", "easy dinner recipes",
    "ways to stay motivated", "musical instruments", "kinds of renewable energy", "team-building activities",
)
_LIST_FORMS = ("List five {}.", "Give me a list of {}.", "Name ten {}.", "What are three {}?",
               "Make a bulleted list of {}.")
_PAIRS = (
    ("a virus", "a bacterium"), ("weather", "climate"), ("a crocodile", "an alligator"), ("TCP", "UDP"),
    ("RAM", "storage"), ("a simile", "a metaphor"), ("stocks", "bonds"), ("affect", "effect"),
    ("a republic", "a democracy"), ("Python", "JavaScript"), ("baking soda", "baking powder"),
    ("a comet", "an asteroid"), ("speed", "velocity"), ("a lake", "a pond"), ("coffee", "tea"),
    ("renting", "buying a home"), ("AI", "machine learning"), ("an LLC", "a corporation"),
    ("mitosis", "meiosis"), ("a hurricane", "a tornado"), ("HTTP", "HTTPS"), ("a frog", "a toad"),
)
_COMPARE_FORMS = ("What is the difference between {} and {}?", "Compare {} and {}.",
                  "Which is better, {} or {}? Explain.")
_GOALS = (
    "staying productive while working from home", "eating healthier", "learning to code",
    "managing time at university", "traveling on a budget", "keeping a conversation going",
    "writing clearly", "running a first marathon", "being a good manager", "public speaking",
    "keeping a journal", "staying safe online", "moving to a new country", "raising a teenager",
    "saving for retirement", "starting a small business", "making a long flight comfortable",
)
_ADVICE_FORMS = ("What are some tips for {}?", "Give me advice on {}.", "What should I know about {}?")
_SENTENCES = (
    "hey can u send me the report by tmrw thx", "The meeting was moved because of reasons.",
    "I think maybe we should probably consider changing the plan.", "The results was very good and everybody liked it.",
    "our product is the best and you should buy it now", "He didn't do nothing wrong.",
    "The cat sat on the mat and it was happy.", "Its going to rain tomorrow so bring you're umbrella.",
    "We need more money for the project or it will fail.", "I am writing to complain about my order.",
)
_REWRITE_FORMS = ("Rewrite this sentence more formally: {}", "Fix the grammar in this sentence: {}",
                  "Make this sentence more polite: {}", "Translate this sentence into French: {}")
_PASSAGES = (
    "The honeybee is a social insect that lives in colonies. Each colony has a queen, thousands of workers, "
    "and a few drones. Workers collect nectar and pollen, build the comb, and care for the young.",
    "Remote work has grown quickly in the last decade. Many employees enjoy the flexibility, while some "
    "companies worry about communication and team culture. Hybrid models try to balance both.",
    "The Great Wall of China was built over many centuries to protect against invasions. It stretches "
    "thousands of kilometres and is made of stone, brick, wood and earth.",
    "Regular exercise improves heart health, strengthens muscles and bones, and can lift mood. Experts "
    "recommend at least 150 minutes of moderate activity each week.",
    "Electric cars use batteries instead of petrol engines. They produce no exhaust, are quiet, and are "
    "cheaper to run, but charging can take longer than filling a tank.",
)
_PASSAGE_FORMS = ("Summarize this text in one sentence: {}", "What is the main idea of this passage? {}",
                  "Write three questions about this text: {}")
_EMAILS = (
    ("my landlord", "a broken heater"), ("my manager", "taking a day off"), ("a customer", "a delayed order"),
    ("my team", "the new project schedule"), ("a professor", "an extension for an assignment"),
    ("a friend", "planning a weekend trip"), ("a hotel", "changing my reservation"),
    ("a colleague", "thanking them for their help"), ("a neighbour", "a noisy party"),
)
_EMAIL_FORMS = ("Write an email to {} about {}.", "Draft a short message to {} about {}.")
_MATH = (
    "What is 17 times 23?", "What is 15% of 240?", "Solve for x: 3x + 7 = 22.", "What is the square root of 144?",
    "If a train travels 60 miles per hour for 2.5 hours, how far does it go?", "Convert 5 kilometers to miles.",
    "What is the area of a circle with radius 4?", "Simplify the fraction 18/24.", "What is 2 to the power of 10?",
    "A shirt costs $40 and is 25% off. What is the sale price?", "What is the sum of the angles in a triangle?",
    "How many seconds are in a day?", "What is the average of 4, 8, 15, 16, 23 and 42?",
    "Is 91 a prime number?", "What is 1000 divided by 8?", "Solve: 2x - 5 = 11.",
)
_CHAT = (
    "Hi! How are you today?", "Tell me a joke.", "What should I cook for dinner tonight?",
    "Can you recommend a good book?", "I'm bored. What can I do?", "What's a fun fact about octopuses?",
    "Tell me something interesting about space.", "What is your favourite colour and why?",
    "Give me a motivational quote.", "What are you able to help me with?", "Suggest a name for my new dog.",
    "I feel nervous about my exam tomorrow.", "Plan a one-day trip to London for me.",
    "What games can I play with friends at a party?", "Tell me a riddle.", "Who was Albert Einstein?",
    "What is the capital of Australia?", "How many legs does a spider have?", "Why do cats purr?",
    "What happened in 1969?", "Write a thank-you note to a teacher.", "Describe your ideal weekend.",
)

# Written apart from the templates above: other phrasings, other subjects.
HELD_OUT_PROMPTS = (
    "How does a refrigerator keep food cold?",
    "Write a Python function that returns the median of a list of numbers.",
    "Give me four ideas for a rainy Sunday with kids.",
    "Write a short poem about a bicycle ride through the countryside.",
    "What causes the seasons on Earth?",
    "Summarize the story of Cinderella in a few sentences.",
    "What are the pros and cons of living in a big city?",
    "Write a JavaScript function that shuffles an array.",
    "How can I make my morning routine more efficient?",
    "Explain what a mortgage is.",
    "Write a short story about a penguin who wants to fly.",
    "List the steps to make a cup of hot chocolate.",
    "Why do leaves change colour in the fall?",
    "What is the difference between a violin and a cello?",
    "Write a polite email asking a shop for a refund.",
    "What are some good habits for healthy teeth?",
    "Explain how a search engine finds web pages.",
    "Describe a busy market in Marrakech.",
    "What is 12 squared minus 44?",
    "Write a Python script that prints the multiplication table of 7.",
    "What makes a good team leader?",
    "Tell me about the history of chess.",
    "How do airplanes stay in the air?",
    "Give me a simple workout I can do without equipment.",
)


def training_prompts(seed: int = 0) -> list[str]:
    """Every training prompt (a few thousand), shuffled by ``seed``; no held-out prompt among them."""
    prompts: list[str] = []
    prompts += [f.format(c) for f in _EXPLAIN for c in _CONCEPTS]
    prompts += [f.format(t) for f in _HOW_TO_FORMS for t in _HOW_TO]
    prompts += [f.format(lang=lang, task=t) for f in _CODE_FORMS for lang in dict.fromkeys(_LANGUAGES)
                for t in _CODE_TASKS]
    prompts += list(_CODE_QUESTIONS)
    prompts += [f.format(s) for f in _PROSE_FORMS for s in _SUBJECTS]
    prompts += [f.format(t) for f in _LIST_FORMS for t in _LIST_THINGS]
    prompts += [f.format(a, b) for f in _COMPARE_FORMS for a, b in _PAIRS]
    prompts += [f.format(g) for f in _ADVICE_FORMS for g in _GOALS]
    prompts += [f.format(s) for f in _REWRITE_FORMS for s in _SENTENCES]
    prompts += [f.format(p) for f in _PASSAGE_FORMS for p in _PASSAGES]
    prompts += [f.format(who, what) for f in _EMAIL_FORMS for who, what in _EMAILS]
    prompts += list(_MATH) + list(_CHAT)
    held_out = set(HELD_OUT_PROMPTS)
    unique = [p for p in dict.fromkeys(prompts) if p not in held_out]
    random.Random(seed).shuffle(unique)
    return unique


def as_chat(prompt: str) -> list[dict]:
    """One user turn, for the model's own chat template."""
    return [{"role": "user", "content": prompt}]
