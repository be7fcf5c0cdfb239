"""English text the tiny model's tokenizer is trained on. Fixed: changing it changes every tiny checkpoint."""

CORPUS = """
The ferry leaves the north pier at seven in the morning and crosses the river in twenty minutes.
On calm days the water is flat and grey, and the gulls follow the boat all the way to the far bank.
When the wind comes from the west the crossing takes longer, and the captain slows the engine.
Passengers stand at the rail with coffee in paper cups and watch the city wake up behind them.
A small girl asks her father why the river never runs out of water. He says the rain keeps it full.
The old lighthouse at the mouth of the harbour has not worked for forty years, but people still paint it.
Every spring a group of volunteers climbs the stairs with brushes, buckets and a long list of repairs.

What is the capital of France? The capital of France is Paris.
What is the largest planet in the solar system? Jupiter is the largest planet.
How many days are there in a week? There are seven days in a week.
How many minutes are there in an hour? There are sixty minutes in an hour.
Which ocean lies between Europe and America? The Atlantic Ocean lies between them.
What do bees make? Bees make honey and wax, and they carry pollen from flower to flower.
Why is the sky blue? Sunlight is scattered by the air, and blue light is scattered the most.

To make bread, mix flour, water, salt and yeast in a large bowl. Knead the dough for ten minutes,
then cover it and let it rise in a warm place until it has doubled in size. Shape the loaf, let it
rise again, and bake it in a hot oven for about forty minutes. The crust should be brown and the
loaf should sound hollow when you tap the bottom. Let it cool before you cut it.

To make tea, boil fresh water and pour it over the leaves. Wait three to five minutes, then remove
the leaves. Some people add milk, some add lemon, and some prefer it plain.

The library opens at nine and closes at six. Children may borrow up to five books at a time.
The reading room on the second floor is quiet, and the large windows look out over the park.
In the park there is a pond with ducks, a playground, and a path that runs around the trees.
On Sundays a man plays the violin near the gate, and people stop to listen on their way home.

The train to the coast was late again. A signal had failed near the bridge, and the driver waited
for permission to continue. Nobody complained very much. One woman read a newspaper, a student slept
with his head against the window, and two friends played cards on a folding table between them.
When the train finally moved, the fields outside were bright with yellow flowers.

A computer stores numbers in memory and follows instructions one step at a time. A program is a list
of such instructions. When many computers work together, they send messages to each other over a
network. Each message has a sender, a receiver, and a body. If a message is lost, the sender may
try again after a short wait. Good programs check their inputs, report errors clearly, and clean up
after themselves when they stop.

A cache keeps recent results close at hand so that the same work is not done twice. A page is a
fixed block of memory. When a request arrives, the server finds free pages, writes into them, and
returns them to the pool when the request is done. If no pages are free, the request must wait.

Once upon a time a fox lived at the edge of a forest. Every evening she walked to the river to drink,
and every evening an old heron stood in the shallow water and watched her. One night the fox asked
the heron why he never moved. The heron said that patience catches more fish than speed. The fox
laughed, but the next evening she sat very still beside him, and after a long time a fish swam past.

The weather today will be cloudy in the morning with light rain in the afternoon. Temperatures will
reach fifteen degrees. Tomorrow will be sunny and warmer, with a gentle breeze from the south.
At night the sky will clear, and you may see the moon and a few bright stars above the hills.

Please write a short letter to your friend. Dear Sam, thank you for the book you sent me. I read it
in two days and enjoyed every page. The garden is full of tomatoes this year, and the apple tree has
more fruit than ever. Come and visit when you can. With best wishes, Alex.

Numbers: one, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve, twenty, thirty,
forty, fifty, sixty, seventy, eighty, ninety, one hundred, one thousand.
Colours: red, orange, yellow, green, blue, purple, black, white, grey, brown, pink.
Days: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday.
Months: January, February, March, April, May, June, July, August, September, October, November, December.

Hello! How are you today? I am fine, thank you. What would you like to do this afternoon?
We could walk to the market, visit the museum, or stay at home and read. Let us decide after lunch.
Can you help me with this question? Of course. Tell me what you know, and we will work it out together.
"""
