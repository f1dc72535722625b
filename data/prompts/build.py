"""Builds the varied prompt set the heads are distilled on (issue 71): prompts from openly licensed sets and prompts
made here from task templates, never a benchmark's. Sources and licences: data/README.md.

usage: python3 data/prompts/build.py --self-instruct DIR --out prompts.jsonl [--seed 0]
    DIR: a checkout of github.com/yizhongw/self-instruct (commit 0b26cca), read with git (`fetch` brings it as a
    bare repository: DIR is then its git directory)

Writes seed records {"id", "source", "turns"}: one user turn, or two where a follow-up is asked. Every prompt is
checked against MT-Bench, Spec-Bench dev and benchmarks/prompts/held_out.jsonl: none shares a run of 10 words with
any of their turns (the check also drops Spec-Bench's GSM8K questions should the seeds hold them).
"""

import argparse
import json
import random
import re
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SHARED = ROOT.parent / "shared" / "data"
BENCHMARKS = (SHARED / "mt_bench_question.jsonl", SHARED / "spec_bench_dev.jsonl", ROOT / "benchmarks" / "prompts" /
              "held_out.jsonl")
T0_DIR = "data/finetuning/t0_train_50k/data_per_template/"
T0_PER_TEMPLATE = 120  # of each of the 295 templates' ~170 distinct prompts
# wiki_hop's prompts hold 790 tokens of entity lists on average (a fifth of every prompt token for 4% of the prompts:
# their prefills would cost more than all the short prompts' answers); multi_news's 925 tokens of several articles
SKIPPED = ("wiki_hop", "multi_news_expand", "multi_news_what", "multi_news_summary_scenario")
SHINGLE = 10  # words in a run that a prompt may not share with a benchmark turn
FOLLOW_UP_SHARE = 0.15  # of the made prompts, those that get a second turn
# prompts of more characters than this (about 256 tokens) are most of the prefill's cost in distilling (on 2 cores a
# 400-token prefill takes about a second, while 32 rows wait): LONG_KEPT of them, at random, for passages to work on
SHORT_CHARS, LONG_KEPT = 1100, 2000

# ---- what users ask, made from templates over topics ----

TOPICS = """the water cycle|photosynthesis|black holes|the French Revolution|climate change|machine learning|the stock
market|inflation|vaccines|the human immune system|renewable energy|electric cars|the Roman Empire|the printing press|
social media|remote work|sleep|meditation|coffee|the Great Wall of China|volcanoes|earthquakes|the Moon landing|the
internet|blockchain|cryptocurrency|artificial intelligence|quantum computing|DNA|evolution|the solar system|Mars|
gravity|electricity|magnetism|the ocean tides|coral reefs|rainforests|deserts|the Arctic|honeybees|dinosaurs|the
Renaissance|the Industrial Revolution|World War I|World War II|the Cold War|ancient Egypt|ancient Greece|democracy|
the United Nations|human rights|free speech|urban planning|public transport|recycling|plastic pollution|fast fashion|
minimalism|budgeting|saving for retirement|credit scores|buying a house|starting a small business|marketing|job
interviews|writing a resume|public speaking|time management|procrastination|learning a new language|learning to code|
playing the guitar|chess|football|basketball|the Olympic Games|marathon training|yoga|healthy eating|vegetarian diets|
baking bread|making pasta|growing tomatoes|houseplants|adopting a dog|caring for a cat|birdwatching|hiking|camping|
travelling on a budget|visiting Japan|visiting Italy|visiting Mexico|museums|classical music|jazz|photography|painting|
poetry|science fiction|detective novels|Shakespeare|film noir|video games|board games|smartphones|password security|
online privacy|cloud computing|databases|open source software|version control|the history of computers|robots|
drones|3D printing|self-driving cars|space tourism|the International Space Station|telescopes|rainbows|thunderstorms|
hurricanes|snow|the seasons|time zones|calendars|the metric system|prime numbers|probability|statistics|geometry|
algebra|fractions|compound interest|supply and demand|globalisation|tariffs|the gig economy|universal basic income|
nuclear power|solar panels|wind turbines|batteries|water purification|antibiotics|mental health|stress|friendship|
parenting|teenagers|online learning|homework|exams|university applications|scholarships|volunteering|charity|
elections|taxes|the justice system|jury duty|copyright|patents|libraries|newspapers|podcasts|advertising|brands|
customer service|negotiation|leadership|teamwork|conflict at work|burnout|productivity apps|email etiquette|
birthday parties|weddings|moving to a new city|learning to drive|bicycles|trains|airports|jet lag|the history of tea|
chocolate|spices|wine making|cheese|sushi|street food|food waste|farming|bees and pollination|forests|rivers|
mountains|islands|glaciers|penguins|whales|octopuses|elephants|wolves|migration of birds|the human brain|the heart|
memory|dreams|habits|motivation|creativity|humour|optimism|gratitude|kindness|honesty|ethics of AI|misinformation|
critical thinking|the scientific method|famous inventors|Marie Curie|Albert Einstein|Leonardo da Vinci|Ada Lovelace|
Nelson Mandela|the history of writing|alphabets|sign language|translation|dialects|the history of money|banks|
insurance|mortgages|stocks and bonds|index funds|home workouts|running shoes|first aid|allergies|the common cold|
vitamins|hydration|air quality|noise pollution|light pollution|city parks|skyscrapers|bridges|tunnels|the Panama
Canal|the Silk Road|pirates|castles|knights|samurai|the Vikings|the Aztecs|the Incas|the Mongol Empire|the Ottoman
Empire|the British Empire|the American Revolution|the moon|comets|meteor showers|eclipses|northern lights""".replace(
    "\n", " ")
TOPICS = [t.strip() for t in TOPICS.split("|") if t.strip()]

TEMPLATES = {
    "explain": ["Explain {t} in simple terms.", "What is the most important thing to understand about {t}?",
                "Explain {t} to a ten-year-old.", "Give me a short overview of {t}.", "How does {t} work?",
                "Why does {t} matter?", "What are common misconceptions about {t}?",
                "Describe the history of {t} in a few paragraphs.", "What are three surprising facts about {t}?",
                "Explain {t} as if I were a university student."],
    "open-question": ["What do you think is the future of {t}?", "What are the pros and cons of {t}?",
                      "Is {t} overrated? Give arguments on both sides.", "How has {t} changed in the last 50 years?",
                      "What questions should I ask to learn more about {t}?", "Who should care about {t}, and why?"],
    "writing": ["Write a short poem about {t}.", "Write a short story that involves {t}.",
                "Write a blog post introduction about {t}.", "Write a persuasive paragraph about {t}.",
                "Write a haiku about {t}.", "Write a limerick about {t}.", "Write a product description for a book "
                "about {t}.", "Write a speech opening for a conference on {t}.",
                "Write an email to a friend recommending they learn about {t}.", "Write a tweet about {t}.",
                "Write a dialogue between two people discussing {t}.", "Write a news headline and lead about {t}."],
    "list": ["List five key facts about {t}.", "Give me a list of ten words related to {t}.",
             "List three books or resources for learning about {t}.", "What are the main steps to get started with "
             "{t}?", "Brainstorm five project ideas about {t}.", "Give me five quiz questions about {t}, with "
             "answers."],
    "advice": ["I want to learn about {t}. Where should I start?", "Give me practical tips about {t}.",
               "My friend is worried about {t}. How can I help them understand it?",
               "Create a one-week study plan to learn about {t}.", "What mistakes do beginners make with {t}?"],
    "compare": ["Compare {t} and {u}.", "What do {t} and {u} have in common?", "Which is more important, {t} or {u}? "
                "Explain your reasoning.", "Write a short essay connecting {t} and {u}."],
    "roleplay": ["You are a tour guide. Tell me about {t}.", "Pretend you are a teacher introducing {t} to a class.",
                 "Act as a journalist interviewing an expert on {t}. Write the first three questions and answers.",
                 "You are a museum curator. Describe an exhibition about {t}."],
    "format": ["Summarize what you know about {t} in three bullet points.", "Explain {t} in exactly two sentences.",
               "Describe {t} in one paragraph of no more than 80 words.", "Make a table of key terms about {t} and "
               "their meanings.", "Write a FAQ with three questions about {t}."],
}

FOLLOW_UPS = ["Can you make that shorter?", "Can you explain that in simpler words?", "Give me an example.",
              "Summarize your answer in one sentence.", "Can you add more detail?", "Why is that?",
              "Rewrite your answer in a more formal tone.", "Rewrite your answer in a casual, friendly tone.",
              "What is the most important point in your answer?", "Turn your answer into a bulleted list.",
              "Can you give me three more ideas?", "What would a critic say about this?",
              "Translate your answer into French.", "Translate your answer into Spanish.",
              "Give your answer a title.", "Are there any exceptions?", "How would you explain this to a child?",
              "What should I do next?", "Write it again, but for a professional audience.",
              "Thank you! Can you also suggest a related topic?"]

PASSAGE_TASKS = {
    "summarization": ["Summarize the following text in a few sentences.\n\n{p}", "TL;DR:\n\n{p}",
                      "{p}\n\nWrite a one-sentence summary of the text above.",
                      "Summarize this in three bullet points:\n\n{p}", "Give this article a title and a short "
                      "summary.\n\n{p}", "Summarize for a busy reader:\n{p}", "Summarize: {p}"],
    "extraction": ["List every person named in the following text.\n\n{p}", "{p}\n\nWhat are the key facts in "
                   "this text? Answer as a list.", "Extract all dates and numbers mentioned in this text, with what "
                   "each refers to:\n\n{p}", "Which places are mentioned in the text below?\n\n{p}",
                   "{p}\n\nWhat is the main point of this passage?"],
    "rewriting": ["Rewrite the following text in plain, simple English.\n\n{p}", "Make this text more concise:"
                  "\n\n{p}", "Rewrite this passage as a short news brief for radio.\n\n{p}", "{p}\n\nRewrite the "
                  "first paragraph above in a formal tone."],
    "rag": ["Use the passage to answer the question.\n\nPassage: {p}\n\nQuestion: {q}", "{p}\n\nBased on the text "
            "above, {q}", "Read the context and answer.\nContext: {p}\nQuestion: {q}\nAnswer:",
            "Answer the question using only this document.\n\nDocument:\n{p}\n\n{q}"],
}

LANGUAGES = ["French", "Spanish", "German", "Italian", "Portuguese", "Dutch"]
TRANSLATE = ["Translate into {l}: \"{s}\"", "Translate the following sentence into {l}.\n{s}",
             "How do you say this in {l}? {s}", "Translate English to {l}: {s}"]

CODE_TASKS = """reverse a string|check whether a number is prime|compute the factorial of a number|return the n-th
Fibonacci number|count the vowels in a string|find the largest element of a list|remove duplicates from a list|merge
two sorted lists|check whether two strings are anagrams|convert Celsius to Fahrenheit|sum the digits of an integer|
flatten a nested list|count word frequencies in a text|validate an email address with a regular expression|read a
CSV file and print each row|sort a list of dictionaries by a key|compute the average of a list of numbers|find the
second largest number in a list|capitalize the first letter of every word|check whether a year is a leap year|find
the greatest common divisor of two numbers|convert a decimal number to binary|implement a stack|implement a queue|
implement a linked list|implement bubble sort|implement merge sort|implement quicksort|compute the median of a list|
transpose a matrix|multiply two matrices|find all pairs in a list that sum to a target|check whether parentheses are
balanced|compress a string with run-length encoding|parse a date string|compute the number of days between two dates|
generate a random password|download a web page and count its links|rotate a list by k positions|find the longest
word in a sentence|check whether a number is a palindrome|compute the power set of a set|find the intersection of
two lists|group words by their first letter|count the lines in a file|convert a list of tuples to a dictionary|
remove whitespace from a string|find the missing number in a list from 1 to n|implement binary search|compute
the dot product of two vectors|parse a JSON string and read a nested field|write a simple HTTP server|debounce a
function|memoize a function|compute a moving average|find the mode of a list|split a list into chunks of size n|
check whether a string is a valid IPv4 address|convert a Roman numeral to an integer|convert an integer to a Roman
numeral|find the longest common prefix of a list of strings|count the islands in a grid|detect a cycle in a linked
list|reverse a linked list|implement a binary search tree|traverse a tree breadth first|compute the edit distance
between two strings|find the shortest path in a graph|implement an LRU cache|shuffle a list|validate a sudoku board|
print a multiplication table|convert a string to title case|read a text file and print the longest line|sum the
even numbers in a list|remove all vowels from a string|check whether a list is sorted|interleave two lists|
compute the cumulative sum of a list|format a number with thousands separators""".replace("\n", " ")
CODE_TASKS = [t.strip() for t in CODE_TASKS.split("|") if t.strip()]
CODE_LANGUAGES = ["Python", "JavaScript", "Java", "C", "C++", "Go", "Rust", "TypeScript", "Ruby", "C#"]
CODE_TEMPLATES = ["Write a {l} function to {t}.", "How do I {t} in {l}? Show the code.", "Write a {l} program that "
                  "can {t}, with comments.", "Write a {l} function to {t}, and explain its time complexity.",
                  "Write unit tests for a {l} function that should {t}."]
SQL_TEMPLATES = ["Write a SQL query that returns the {n} most recent {things} from a table called {table}.",
                 "Write a SQL query to count the {things} per {group} in the table {table}.",
                 "Explain what this SQL query does: SELECT {group}, COUNT(*) FROM {table} GROUP BY {group} HAVING "
                 "COUNT(*) > {n};"]
SQL_TABLES = [("orders", "orders", "customer_id"), ("employees", "employees", "department"), ("posts", "posts",
              "author"), ("books", "books", "genre"), ("songs", "songs", "artist"), ("flights", "flights", "airline")]

MATH_NAMES = ["Ana", "Ben", "Chloe", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jack", "Kofi", "Lena",
              "Mateo", "Nina", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tara"]
MATH_ITEMS = [("apples", 0.5, 2), ("notebooks", 2, 6), ("tickets", 8, 25), ("shirts", 12, 40), ("pencils", 0.25, 1),
              ("books", 5, 20), ("cupcakes", 1, 4), ("plants", 3, 15)]


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def shingles(text: str) -> set[tuple[str, ...]]:
    w = words(text)
    return {tuple(w[i: i + SHINGLE]) for i in range(max(len(w) - SHINGLE + 1, 0))}


def benchmark_shingles() -> set[tuple[str, ...]]:
    out = set()
    for path in BENCHMARKS:
        for line in path.read_text().split("\n"):
            if line.strip():
                for turn in json.loads(line)["turns"]:
                    out |= shingles(turn)
    return out


def git_files(repo: Path, prefix: str) -> list[str]:
    names = subprocess.run(["git", "-C", str(repo), "ls-tree", "-r", "--name-only", "HEAD", prefix],
                           capture_output=True, text=True, check=True).stdout.split("\n")
    return [n for n in names if n]


def git_text(repo: Path, name: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "show", f"HEAD:{name}"], capture_output=True, text=True,
                          check=True).stdout


def t0_prompts(repo: Path, rng: random.Random):
    """P3's prompts as self-instruct sampled them (up to T0_PER_TEMPLATE distinct ones per template) -> (prompts as
    (source, text), and for the made tasks: passages, (passage, question) pairs, closed-book questions)."""
    prompts, passages, questions, direct = [], [], [], []
    for name in git_files(repo, T0_DIR):
        template = Path(name).stem
        if template.startswith(SKIPPED):
            continue
        rows = [json.loads(line) for line in git_text(repo, name).split("\n") if line.strip()]
        distinct = list(dict.fromkeys(r["prompt"].strip() for r in rows))
        rng.shuffle(distinct)
        prompts += [(f"p3:{template}", p) for p in distinct[:T0_PER_TEMPLATE]]
        for row in rows:
            text = row["prompt"]
            if template.startswith(("cnn_dailymail", "xsum_DOC_write", "multi_news_summary", "samsum_Summarize_")):
                body = re.sub(r"^(Summarize: )", "", text.strip()).split("\n\n===")[0].strip()
                body = re.sub(r"\n\n(Write|Summarize|Give|Write a summary).*$", "", body, flags=re.DOTALL)
                if 300 < len(body) < 6000:
                    passages.append(body)
            match = re.search(r"Question: (.+?)\n.*?(?:Context|Movie plot): (.+)", text, flags=re.DOTALL)
            if template.startswith(("adversarial_qa_dbert_answer", "duorc_SelfRC_answer")) and match:
                questions.append((match[2].strip(), match[1].strip()))
            match = re.search(r'Given the following passage\s+"(.+?)",\s+answer the following question\. Note that '
                              r'the answer is present within the text\.\s+Question: (.+)', text, flags=re.DOTALL)
            if match:
                questions.append((match[1].strip(), match[2].strip()))
            asked = text.replace("What is this question asking for?", "").strip()
            match = re.fullmatch(r"(?:Answer this question: |Q: )?(.+?\?)\??(?:\n+A:)?", asked, flags=re.DOTALL)
            if template.startswith(("trec_fine_grained_open", "wiki_qa_Direct", "kilt_tasks_hotpotqa_straighforward",
                                    "sciq_Direct_Question_Closed")) and match:
                question = re.sub(r"\s+\?$", "?", match[1].strip())
                direct.append(question[0].upper() + question[1:])
    return prompts, list(dict.fromkeys(passages)), list(dict.fromkeys(questions)), list(dict.fromkeys(direct))


def self_instruct_prompts(repo: Path) -> list[tuple[str, str]]:
    out = []
    for name, source in (("data/seed_tasks.jsonl", "self-instruct:seed"),
                         ("human_eval/user_oriented_instructions.jsonl", "self-instruct:user-oriented")):
        for line in git_text(repo, name).split("\n"):
            if line.strip():
                task = json.loads(line)
                for instance in task["instances"]:
                    text = task["instruction"] + (f"\n\n{instance['input']}" if instance["input"].strip() else "")
                    out.append((source, text))
    return out


def made_prompts(rng: random.Random, passages: list[str], questions: list[tuple[str, str]], direct: list[str]
                 ) -> list[tuple[str, str]]:
    """Prompts made here: templates over topics, tasks over P3's passages, translations of their sentences, code,
    word problems with fresh numbers, and P3's questions asked as they are."""
    out = []
    for kind, templates in TEMPLATES.items():
        for topic in TOPICS:
            for template in rng.sample(templates, min(len(templates), 7 if kind != "compare" else 3)):
                out.append((f"made:{kind}", template.format(t=topic, u=rng.choice(TOPICS))))
    out += [("made:qa", question) for question in direct]
    rng.shuffle(passages)
    for n, passage in enumerate(passages):
        kind = list(PASSAGE_TASKS)[n % 3]
        out.append((f"made:{kind}", rng.choice(PASSAGE_TASKS[kind]).format(p=passage)))
    for passage, question in questions:
        question = question[0].lower() + question[1:] if question else question
        out.append(("made:rag", rng.choice(PASSAGE_TASKS["rag"]).format(p=passage, q=question)))
    sentences = [s for p in passages for s in re.split(r"(?<=[.!?])\s+", p)[:3] if 40 < len(s) < 200]
    rng.shuffle(sentences)
    for sentence in sentences[:4000]:
        out.append(("made:translation", rng.choice(TRANSLATE).format(l=rng.choice(LANGUAGES), s=sentence)))
    for task in CODE_TASKS:
        for language in CODE_LANGUAGES:
            out.append(("made:code", rng.choice(CODE_TEMPLATES).format(l=language, t=task)))
    for template in SQL_TEMPLATES:
        for table, things, group in SQL_TABLES:
            out.append(("made:code", template.format(n=rng.randrange(3, 20), things=things, table=table, group=group)))
    out += [("made:math", math_problem(rng)) for _ in range(4000)]
    return out


def math_problem(rng: random.Random) -> str:
    """A word problem with fresh numbers: a purchase, a rate, a percentage or a split."""
    name, other = rng.sample(MATH_NAMES, 2)
    item, low, high = rng.choice(MATH_ITEMS)
    count, price = rng.randrange(2, 30), round(rng.uniform(low, high) * 4) / 4
    kind = rng.randrange(5)
    if kind == 0:
        return (f"{name} buys {count} {item} at ${price:.2f} each and pays with a"
                f" ${(int(count * price) // 10 + 1) * 10} bill. How much change does {name} get?")
    if kind == 1:
        hours, speed = rng.randrange(2, 9), rng.randrange(30, 120)
        return (f"A train travels at {speed} km per hour for {hours} hours, then half as fast for 1 hour."
                " How far does it go?")
    if kind == 2:
        percent, total = rng.choice([10, 15, 20, 25, 30, 40]), rng.randrange(40, 400)
        return f"A jacket costs ${total}. It is on sale for {percent}% off. What is the sale price? Show your steps."
    if kind == 3:
        people = rng.randrange(3, 9)
        return (f"{name} and {people - 1} friends share {count * people} {item} equally."
                f" {other} gives them {count} more to share. How many {item} does each person get in the end?")
    return (f"{name} saves ${rng.randrange(5, 60)} every week."
            f" {other} saves twice as much but started {rng.randrange(2, 8)} weeks later."
            f" After {rng.randrange(10, 30)} weeks of {name} saving, who has saved more, and by how much?")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--self-instruct", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    t0, passages, questions, direct = t0_prompts(args.self_instruct, rng)
    made = made_prompts(rng, passages, questions, direct)
    banned = benchmark_shingles()
    candidates = t0 + self_instruct_prompts(args.self_instruct) + made
    long = [i for i, (_, text) in enumerate(candidates) if len(text.strip()) > SHORT_CHARS]
    long_kept = set(rng.sample(long, min(LONG_KEPT, len(long))))
    records, seen, dropped = [], set(), 0
    for i, (source, text) in enumerate(candidates):
        text = text.strip()
        if not text or text in seen or (len(text) > SHORT_CHARS and i not in long_kept):
            continue
        seen.add(text)
        if shingles(text) & banned:
            dropped += 1
            continue
        turns = [text]
        if source.startswith("made:") and rng.random() < FOLLOW_UP_SHARE:
            turns.append(rng.choice(FOLLOW_UPS))
        records.append({"id": f"mix-{len(records)}", "source": source, "turns": turns})
    rng.shuffle(records)
    args.out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    by_source: dict[str, int] = {}
    for record in records:
        key = record["source"].split(":")[0] + ":" + record["source"].split(":")[1].split("_")[0]
        by_source[key] = by_source.get(key, 0) + 1
    print(f"{len(records)} prompts ({sum(len(r['turns']) == 2 for r in records)} with a second turn), {dropped} "
          f"dropped for sharing {SHINGLE} words with a benchmark -> {args.out}")
    print(json.dumps(dict(sorted(by_source.items(), key=lambda kv: -kv[1])), indent=1))


if __name__ == "__main__":
    main()
