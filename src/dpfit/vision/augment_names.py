"""The names of the training augmentations, torch-free so the CLI parser can offer them.

"shift" moves each image by up to a fraction of its side in each direction (a random crop
of the image padded with black, as in the usual "pad 4, crop 32" of CIFAR training);
"shift-flip" also mirrors half the images left-right (right for clothes or scenes, wrong for
digits or text). The pixels are moved by :func:`dpfit.vision.data.augment_pixels`.
"""

AUGMENTS = ("none", "shift", "shift-flip")
