"""Helpdesk: a customer-support agent on a sealed shop database (SQLite).

Tables: ``customers``, ``products`` (each in a category), ``refund_policy`` (the refund window
in days per category), ``orders``, ``order_items`` and ``tickets`` (the log of refunds and
address changes), seeded from small word lists and ``db_seed``. "Today" is fixed (``TODAY``).

Tasks are customer messages made from the seeded data, with the expected outcome:

===================  ============================================  =======================
kind                 the customer asks                             right outcome
===================  ============================================  =======================
``refund``           money back for an order inside its window     refund: order + ticket
``refuse_late``      the same, past the order's refund window      no change; say why
``refuse_refunded``  the same, for an order already refunded       no change; say why
``refuse_other``     a refund of order #N, another customer's      no change; say why
``status``           where an order is (processing or shipped)     no change; the status
``address``          a new postal address                          address + ticket
===================  ============================================  =======================

The tools do not check the policy (the agent must), so refunding everything fails the
refusals, about 36% of the tasks. Customers whose id is a multiple of 5 are held out.

Score components, each in [0, 1]: ``action`` (the database changed exactly as expected; a
task without a change counts only once the customer and the order meant were looked up and
a reply was given, so doing nothing is not free), ``reply`` (share of the required facts in the final reply; 0 for a refund reply that
also says it cannot refund), ``customer`` (find_customer found the asker), ``order``
(get_order opened the order meant, divided by the distinct orders opened; for address tasks
equal to ``customer``), ``format`` (share of tool calls that parsed, named a tool and had
valid arguments; 0 without any, so chatting is not safer than trying a call). A final reply that
reports a refund or an address change (``CLAIMS``) the episode did not make scores 0 on every
component: the look-ups before a lie are not paid.
"""

from __future__ import annotations

import datetime
import itertools
import random
import re
import sqlite3
from typing import Any, ClassVar

from grooves.envs.base import State, call_text, tool
from grooves.envs.sqlite import SQLiteApp
from grooves.types import Task

TODAY = datetime.date(2024, 6, 30)
FIRST = ["jane", "omar", "li", "sara", "tom", "ana", "raj", "eva"]
LAST = ["doe", "khan", "chen", "berg", "ross", "silva", "patel", "novak"]
MORE_FIRST, MORE_LAST = ["kim", "noah"], ["okafor", "muller"]  # for shops of more than 64 customers
LAST_FIRST = ["mia", "ivan", "zoe", "leo", "nina", "hugo"]  # and these past 100, up to 256
LAST_LAST = ["garcia", "ito", "larsen", "moreau", "rossi", "weber"]
NAMES = ((FIRST, LAST), (FIRST + MORE_FIRST, LAST + MORE_LAST),
         (FIRST + MORE_FIRST + LAST_FIRST, LAST + MORE_LAST + LAST_LAST))  # first and last names by shop size
MOST_CUSTOMERS = len(NAMES[-1][0]) * len(NAMES[-1][1])
COLORS = ["blue", "red", "green", "black", "white"]
ITEMS = {"kettle": "kitchen", "toaster": "kitchen", "mug": "kitchen", "lamp": "home", "blanket": "home",
         "rug": "home", "headphones": "electronics", "speaker": "electronics", "charger": "electronics"}
WINDOW_DAYS = {"kitchen": 30, "home": 60, "electronics": 14}
STREETS, CITIES = ["Elm", "Oak", "Mill", "Park", "Lake", "High"], ["Springfield", "Riverton", "Lakeside", "Fairview"]
STORIES = {"processing": 1, "shipped": 2, "recent": 8, "late": 3, "refunded": 2}  # an order's story: its weight
FORMAT_ERRORS = ("tool_errors/malformed", "tool_errors/unknown_tool", "tool_errors/bad_arguments")
REFUSAL = ["cannot", "can't", "can not", "unable", "not able", "won't", "not eligible"]
REASONS = {"refuse_late": ["window", "expired", "too late", "days"], "refuse_refunded": ["already"],
           "refuse_other": ["belong", "your account", "another customer", "not yours", "not your order"]}
REFUSED = ["cannot refund", "can't refund", "unable to refund", "not eligible"]  # contradicts a refund
# A reply's first-person report of a change, by the ticket kind the change leaves: a reply that reports
# one the episode never made lies to the customer (RL learned "I have issued a refund of 17.99 for
# order #60." without the call, docs/agents.md, issue 28).
CLAIMS = {"refund": re.compile(r"\bi(?: have|'ve)? (?:issued|processed|made|sent)\b[^.!?]*\brefund|\bi(?: have|'ve)? "
                               r"refunded\b|\byour refund (?:has been|was|is) (?:issued|processed|sent)"),
          "address": re.compile(r"\bi(?: have|'ve)? (?:changed|updated)\b[^.!?]*\baddress|\baddress "
                                r"(?:has been|was|is now) (?:changed|updated)")}
ASKS = {"refund": ["My order of the {product} arrived broken, can I get my money back?",
                   "I want a refund for the {product} I ordered, it does not work."],
        "refuse_other": ["Please refund order #{order}, the {product} stopped working."],
        "status": ["Where is my {product}? I ordered it on {placed_on}."],
        "address": ["I moved, please change my address to {address}."]}

SCHEMA = """
CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, email TEXT UNIQUE NOT NULL, address TEXT);
CREATE TABLE refund_policy (category TEXT PRIMARY KEY, window_days INTEGER NOT NULL);
CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT, category TEXT REFERENCES refund_policy, price REAL);
CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER REFERENCES customers, placed_on TEXT,
                     status TEXT, total REAL);
CREATE TABLE order_items (id INTEGER PRIMARY KEY, order_id INTEGER REFERENCES orders,
                          product_id INTEGER REFERENCES products, quantity INTEGER);
CREATE TABLE tickets (id INTEGER PRIMARY KEY, customer_id INTEGER REFERENCES customers,
                      order_id INTEGER REFERENCES orders, kind TEXT, amount REAL);
"""
ORDER = """SELECT o.*, date(o.placed_on, '+' || min(r.window_days) || ' days') AS refund_window_ends
           FROM orders o JOIN order_items i ON i.order_id = o.id JOIN products p ON p.id = i.product_id
           JOIN refund_policy r ON r.category = p.category WHERE o.id = ? GROUP BY o.id"""
ITEMS_OF = """SELECT p.id AS product_id, p.name, i.quantity FROM order_items i JOIN products p ON p.id = i.product_id
              WHERE i.order_id = ? ORDER BY i.id"""
PURCHASES = """SELECT p.name AS product, o.id AS order_id, o.placed_on FROM orders o
               JOIN order_items i ON i.order_id = o.id JOIN products p ON p.id = i.product_id
               WHERE o.customer_id = ? ORDER BY o.placed_on DESC, o.id DESC, i.id"""


def address(rng: random.Random) -> str:
    return f"{rng.randint(1, 99)} {rng.choice(STREETS)} Street, {rng.choice(CITIES)}"


def ticket(customer_id: int, order_id: int | None, kind: str, amount: float | None) -> dict[str, Any]:
    return {"customer_id": customer_id, "order_id": order_id, "kind": kind, "amount": amount}


class Helpdesk(SQLiteApp):
    name = "helpdesk"
    description = "customer support on a shop database: refunds (or refusals), address changes, order status"
    schema: ClassVar[str] = SCHEMA
    weights: ClassVar[dict[str, float]] = {"action": 0.4, "reply": 0.2, "customer": 0.15, "order": 0.15,
                                           "format": 0.1}
    max_tokens = 1024
    customers = 64  # up to MOST_CUSTOMERS; 80 gives 64 held-out tasks, 240 gives 192
    system_prompt: ClassVar[str] = (
        f"You are the support agent of an online shop. Today is {TODAY}. Look the customer up by email or "
        "name (find_customer), find the order they mean (list_orders, get_order) and follow the policy:\n"
        "- Refund (issue_refund, the whole order total) only an order of the customer who asks, not refunded "
        "already, and only while its refund window is open (get_order shows refund_window_ends and "
        "refund_window_open; the window is "
        + ", ".join(f"{days} days for {category}" for category, days in WINDOW_DAYS.items()) + " items).\n"
        "- A new address: update_address with the address exactly as the customer wrote it.\n"
        "- A question about an order: tell them its status.\n"
        "The tools do not check the policy; you do. End with reply(message): what you did and the amount "
        "refunded, or why you cannot refund, or the order's status.")

    def seed_data(self, db: sqlite3.Connection, rng: random.Random) -> None:
        db.executemany("INSERT INTO refund_policy VALUES (?, ?)", WINDOW_DAYS.items())
        products = [(f"{color} {item}", category, rng.randint(8, 120) + 0.99)
                    for color, (item, category) in itertools.product(COLORS, ITEMS.items())]
        db.executemany("INSERT INTO products (name, category, price) VALUES (?, ?, ?)", products)
        people: list[tuple[str, str]] = []
        for first, last in NAMES:  # a bigger shop's people come after a smaller one's, so that the
            if len(people) < self.customers:  # shops of 64 and of 80 stay as they were
                people += [p for p in itertools.product(first, last) if p not in people]
        if not 1 <= self.customers <= MOST_CUSTOMERS:
            raise ValueError(f"helpdesk: customers = {self.customers}; a shop has 1 to {MOST_CUSTOMERS}")
        for cid, (first, last) in enumerate(rng.sample(people, self.customers), 1):
            db.execute("INSERT INTO customers VALUES (?, ?, ?, ?)",
                       (cid, f"{first.title()} {last.title()}", f"{first}.{last}@example.com", address(rng)))
            bought = rng.sample(range(1, len(products) + 1), 6)  # distinct, so a product names one order
            for k in range(3):
                items = [(pid, rng.choice([1, 1, 1, 2])) for pid in bought[2 * k: 2 * k + 1 + (rng.random() < 0.3)]]
                window = min(WINDOW_DAYS[products[pid - 1][1]] for pid, _ in items)
                story = rng.choices(list(STORIES), list(STORIES.values()))[0]
                age = {"processing": (0, 1), "shipped": (2, 5), "recent": (6, window - 1), "refunded": (6, window - 1),
                       "late": (window + 3, window + 60)}[story]  # days before TODAY; recent ones inside the window
                status = "delivered" if story in ("recent", "late") else story
                total = round(sum(products[pid - 1][2] * quantity for pid, quantity in items), 2)
                placed_on = (TODAY - datetime.timedelta(days=rng.randint(*age))).isoformat()
                oid = db.execute("INSERT INTO orders (customer_id, placed_on, status, total) VALUES (?, ?, ?, ?)",
                                 (cid, placed_on, status, total)).lastrowid
                db.executemany("INSERT INTO order_items (order_id, product_id, quantity) VALUES (?, ?, ?)",
                               [(oid, pid, quantity) for pid, quantity in items])
                if status == "refunded":
                    db.execute("INSERT INTO tickets (customer_id, order_id, kind, amount) VALUES (?, ?, 'refund', ?)",
                               (cid, oid, total))

    # --- tools ----------------------------------------------------------------------

    def _order(self, db: sqlite3.Connection, order_id: int) -> dict[str, Any]:
        order = self.row(db, ORDER, order_id)
        if order is None:
            raise ValueError(f"no order with id {order_id}")
        # What a shop screen shows beside the deadline (docs/agents.md: the 135M model does not
        # compare the dates itself). It says nothing of the other rules: refunded already, whose order.
        open_ = order["refund_window_ends"] >= TODAY.isoformat()
        return order | {"refund_window_open": open_, "items": self.rows(db, ITEMS_OF, order_id)}

    @tool
    def find_customer(self, state: State, query: str) -> dict[str, Any]:
        """Find a customer by email address or full name.

        Args:
            query: the customer's email address or full name, as they wrote it
        """
        query = " ".join(query.split())
        found = self.row(self.db(state), "SELECT * FROM customers WHERE lower(email) = lower(?) "
                                         "OR lower(name) = lower(?)", query, query)
        if found is None:
            raise ValueError(f"no customer with email or name {query!r}")
        state.data.setdefault("customers", []).append(found["id"])
        return found

    @tool
    def list_orders(self, state: State, customer_id: int) -> list[dict[str, Any]]:
        """A customer's purchases, newest first: one row per product, with the id and date of the
        order it is in.

        Args:
            customer_id: the customer's id (from find_customer)
        """
        # A row per product, its order's id right after its name, as a shop's "your purchases"
        # page lists them: grouped by order (id first, products last), the 135M model opened the
        # order meant on about a third of the tasks (docs/agents.md, issue 28 part 2).
        db = self.db(state)
        if self.row(db, "SELECT id FROM customers WHERE id = ?", customer_id) is None:
            raise ValueError(f"no customer with id {customer_id}")
        return self.rows(db, PURCHASES, customer_id)

    @tool
    def get_order(self, state: State, order_id: int) -> dict[str, Any]:
        """One order in full: its customer, status, total, the last day it can be refunded, whether its
        refund window is still open today (refund_window_open) and its items.

        Args:
            order_id: the order's id
        """
        order = self._order(self.db(state), order_id)
        state.data.setdefault("orders", []).append(order_id)
        return order

    @tool
    def get_product(self, state: State, product_id: int) -> dict[str, Any]:
        """A product: name, category, price and the refund window of its category in days.

        Args:
            product_id: the product's id (get_order lists them)
        """
        found = self.row(self.db(state), "SELECT p.*, r.window_days AS refund_window_days FROM products p "
                                         "JOIN refund_policy r ON r.category = p.category WHERE p.id = ?", product_id)
        if found is None:
            raise ValueError(f"no product with id {product_id}")
        return found

    @tool
    def issue_refund(self, state: State, order_id: int) -> dict[str, Any]:
        """Refund an order's whole total to the customer who placed it. It does not check the policy.

        Args:
            order_id: the order's id
        """
        db = self.db(state)
        order = self._order(db, order_id)
        with db:  # one transaction: the order and its ticket together
            db.execute("UPDATE orders SET status = 'refunded' WHERE id = ?", (order_id,))
            db.execute("INSERT INTO tickets (customer_id, order_id, kind, amount) VALUES (?, ?, 'refund', ?)",
                       (order["customer_id"], order_id, order["total"]))
        return {"order_id": order_id, "refunded": order["total"]}

    @tool
    def update_address(self, state: State, customer_id: int, address: str) -> dict[str, Any]:
        """Change a customer's postal address.

        Args:
            customer_id: the customer's id (from find_customer)
            address: the new address, as the customer wrote it
        """
        db, address = self.db(state), " ".join(address.split())
        with db:
            if db.execute("UPDATE customers SET address = ? WHERE id = ?", (address, customer_id)).rowcount == 0:
                raise ValueError(f"no customer with id {customer_id}")
            db.execute("INSERT INTO tickets (customer_id, kind) VALUES (?, 'address')", (customer_id,))
        return {"customer_id": customer_id, "address": address}

    @tool
    def reply(self, state: State, message: str) -> str:
        """Send the final reply to the customer; this ends the conversation.

        Args:
            message: what you did, or why you cannot do it, or the order's status
        """
        self.finish(state, message, "answer")
        return "sent"

    # --- tasks and scoring -----------------------------------------------------------------

    def tasks(self, split: str = "train", n: int | None = None, seed: int = 0) -> list[Task]:
        if split not in ("train", "heldout"):
            raise ValueError(f"helpdesk: unknown split {split!r}; the splits are train and heldout")
        pool = [t for t in self._all_tasks() if (t["expected"]["customer_id"] % 5 == 0) == (split == "heldout")]
        random.Random(seed).shuffle(pool)
        return pool[:n]

    def _all_tasks(self) -> list[Task]:
        """One task per order of each customer (its story decides the kind), and one more per customer:
        a new address (even ids) or a refund of someone else's recent order (odd ids)."""
        db, rng = self.template, random.Random(f"{self.db_seed}:tasks")
        since = (TODAY - datetime.timedelta(days=min(WINDOW_DAYS.values()))).isoformat()
        recent = self.rows(db, "SELECT id, customer_id FROM orders WHERE status = 'delivered' AND placed_on > ?", since)
        out = []
        for customer in self.rows(db, "SELECT * FROM customers ORDER BY id"):
            cid = customer["id"]
            for own in self.rows(db, "SELECT id FROM orders WHERE customer_id = ? ORDER BY id", cid):
                order = self._order(db, own["id"])
                kind = {"processing": "status", "shipped": "status", "refunded": "refuse_refunded"}.get(
                    order["status"], "refund" if order["refund_window_ends"] >= TODAY.isoformat() else "refuse_late")
                out.append(self._task(customer, order, kind, rng))
            if cid % 2:
                other = rng.choice([o["id"] for o in recent if o["customer_id"] != cid])
                out.append(self._task(customer, self._order(db, other), "refuse_other", rng))
            else:
                out.append(self._task(customer, None, "address", rng))
        return out

    def _task(self, customer: dict, order: dict | None, kind: str, rng: random.Random) -> Task:
        cid, new_address = customer["id"], address(rng) if kind == "address" else None
        changes, contradicting = {}, []
        if kind == "refund":
            facts, contradicting = [[f"{order['total']:.2f}"], ["refund"]], REFUSED
            changes = {"orders": {"updated": {str(order["id"]): {"status": "refunded"}}},
                       "tickets": {"added": [ticket(cid, order["id"], "refund", order["total"])]}}
        elif kind == "address":
            facts = [[new_address.lower()]]
            changes = {"customers": {"updated": {str(cid): {"address": new_address}}},
                       "tickets": {"added": [ticket(cid, None, "address", None)]}}
        elif kind == "status":
            facts = [[order["status"]]]
        else:
            facts = [REFUSAL, REASONS[kind]]
        who = customer["email"] if rng.random() < 0.5 else customer["name"]
        about = ({"product": order["items"][0]["name"], "order": order["id"], "placed_on": order["placed_on"]}
                 if order else {})
        ask = rng.choice(ASKS.get(kind, ASKS["refund"])).format(address=new_address, **about)
        return {"id": f"helpdesk-{kind}-{cid}-{order['id'] if order else 'address'}",
                "prompt": f"Hi, I'm {who}. {ask}", "kind": kind,
                "expected": {"customer_id": cid, "order_id": order["id"] if order else None, "changes": changes,
                             "facts": facts, "contradicting": contradicting}}

    def demonstrate(self, task: Task) -> list[str]:
        """Look the customer up as they wrote themselves, open the order meant (through their
        order list when they named a product, directly when they gave its number), act as the
        policy says, and reply with the facts the score looks for. Before opening an order picked
        from the customer's purchases, the demo quotes the row of the product they named; before a
        refund or a refusal, it writes down the order's fields the policy rests on (whose it is, its
        status, ``refund_window_open``), then the verdict. Each choice is taken next to what it
        reads (docs/agents.md: trained on bare calls, the 135M model's choice ignored the flag and
        mostly opened the wrong order)."""
        expected, kind = task["expected"], task["kind"]
        cid, oid = expected["customer_id"], expected["order_id"]
        who = re.match(r"Hi, I'm (.+?)\. ", task["prompt"])
        turns = [call_text("find_customer", query=who.group(1) if who else
                           self.row(self.template, "SELECT email FROM customers WHERE id = ?", cid)["email"])]
        if kind == "address":
            new = expected["changes"]["customers"]["updated"][str(cid)]["address"]
            return turns + [call_text("update_address", customer_id=cid, address=new),
                            call_text("reply", message=f"I have changed your address to {new}.")]
        order = self._order(self.template, oid)
        if kind != "refuse_other":  # the product they named, quoted from list_orders' row of it
            product = next(item["name"] for item in order["items"] if item["name"] in task["prompt"])
            turns += [call_text("list_orders", customer_id=cid),
                      f'{{"product": "{product}", "order_id": {oid}}}\n' + call_text("get_order", order_id=oid)]
        else:
            turns.append(call_text("get_order", order_id=oid))
        reply = {"refund": f"I have issued a refund of {order['total']:.2f} for order #{oid}.",
                 "status": f"Your order #{oid} is {order['status']}.",
                 "refuse_late": f"I'm sorry, I cannot refund order #{oid}: its refund window ended on "
                                f"{order['refund_window_ends']}.",
                 "refuse_refunded": f"I cannot refund order #{oid}: it has already been refunded.",
                 "refuse_other": f"I cannot refund order #{oid}: it does not belong to your account."}[kind]
        if kind == "status":
            return turns + [call_text("reply", message=reply)]
        verdict = {"refund": "I can refund it.", "refuse_late": "Window closed: I cannot refund it.",
                   "refuse_refunded": "Refunded already: I cannot refund it.",
                   "refuse_other": "Not your order: I cannot refund it."}[kind]
        read = (f"Order #{oid}: customer_id {order['customer_id']} (you are {cid}), status {order['status']}, "
                f"refund_window_open {str(order['refund_window_open']).lower()}. {verdict}\n")
        if kind == "refund":
            return turns + [read + call_text("issue_refund", order_id=oid), call_text("reply", message=reply)]
        return turns + [read + call_text("reply", message=reply)]

    def solved(self, scores: dict[str, float]) -> bool:
        return scores["action"] == 1.0 and scores["reply"] == 1.0  # the right change, and said so

    def score(self, state: State) -> dict[str, float]:
        expected = state.task["expected"]
        customer = float(expected["customer_id"] in state.data.get("customers", []))
        opened = set(state.data.get("orders", []))
        # A task without a change is not won by inaction: the decision must be informed (the asker
        # and the order meant were looked up) and told (the reply gives the status, or refuses).
        # RL found two gaps: when only the look-up was needed, it learned to find the customer, then
        # break every call after it; when any reply did, to refuse every request, status questions too.
        informed = customer == 1.0 and (expected["order_id"] is None or expected["order_id"] in opened)
        answer = (state.answer or "").lower().replace("\u2019", "'")
        told = any(word in answer for word in expected["facts"][0])
        changes = self.changes(state)
        action = changes == expected["changes"] and (bool(expected["changes"]) or (informed and told))
        said = sum(any(word in answer for word in words) for words in expected["facts"]) / len(expected["facts"])
        calls = state.counters["tool_calls"] + state.counters["tool_errors/malformed"]
        bad = sum(state.counters[key] for key in FORMAT_ERRORS)
        made = {row["kind"] for row in changes.get("tickets", {}).get("added", [])}
        if any(claim.search(answer) for kind, claim in CLAIMS.items() if kind not in made):
            return dict.fromkeys(self.weights, 0.0)  # a reported change never made: no step of it is paid
        return {"action": float(action),
                "reply": 0.0 if any(word in answer for word in expected["contradicting"]) else said,
                "customer": customer,
                "order": (expected["order_id"] in opened) / max(1, len(opened)) if expected["order_id"] else customer,
                "format": 1.0 - bad / calls if calls else 0.0}  # no call: no credit for chat
